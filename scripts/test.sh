#!/usr/bin/env bash
# Set up .venv (with the dev tools) if needed, lint, and run the whole test suite on the CPU.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/model -x`.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh" dev
ruff check .
export OMP_NUM_THREADS=1
python -m pytest -n 2 --dist loadfile -q --durations=15 "$@"
