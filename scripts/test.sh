#!/usr/bin/env bash
# Set up .venv (with the dev tools) if needed, lint, and run the test suite on the CPU.
#   bash scripts/test.sh            the suite less its slow tier (<= 10 min on 2 cores)
#   bash scripts/test.sh --quick    one test per feature (the development loop; <= 3 min)
#   bash scripts/test.sh --slow     the slow tier alone: end-to-end runs (README commands,
#                                   compiled models, chaos, 8-rank start-up) whose parts the
#                                   default tier tests faster; CI runs it after the default
#   bash scripts/test.sh --all      both tiers
# Other arguments go to pytest, e.g. `bash scripts/test.sh tests/model -x`; a `-m EXPR` of
# theirs is joined with the tier's, e.g. `-m "not kernel_free"` runs "(not kernel_free) and not slow".
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh" dev
ruff check .
export OMP_NUM_THREADS=1
tier="not slow"
user_mark=""
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) tier="quick and not slow" ;;
        --slow) tier="slow" ;;
        --all) tier="" ;;
        -m) user_mark="$2"; shift ;;
        *) args+=("$1") ;;
    esac
    shift
done
mark="$tier"
if [ -n "$user_mark" ]; then mark="($user_mark)${tier:+ and ($tier)}"; fi
if [ -n "$mark" ]; then args=(-m "$mark" "${args[@]}"); fi
python -m pytest -n 2 --dist loadfile -q --durations=15 "${args[@]}"
