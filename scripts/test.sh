#!/usr/bin/env bash
# Set up .venv (with the dev tools) if needed, lint, and run the test suite on the CPU.
#   bash scripts/test.sh            the whole suite (what CI runs; <= 10 min on 2 cores)
#   bash scripts/test.sh --quick    one test per feature (the development loop; <= 3 min)
# Other arguments go to pytest, e.g. `bash scripts/test.sh tests/model -x`.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh" dev
ruff check .
export OMP_NUM_THREADS=1
args=()
for a in "$@"; do
    if [ "$a" = "--quick" ]; then args+=(-m quick); else args+=("$a"); fi
done
python -m pytest -n 2 --dist loadfile -q --durations=15 "${args[@]}"
