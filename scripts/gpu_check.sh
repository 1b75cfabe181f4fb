#!/bin/bash
# Every check that needs a CUDA GPU, sized for the loan we get: one H100 or H200, <= 8 min wall
# from a fresh machine, one command. The parts, in order (--plan prints each with its estimate):
#   install        pip install -r requirements.txt (the torch wheel is cached on the lent machine)
#   kernel_tests   the kernel tests on the device (with the real-size `gpu` ones)
#   kernel_bench   the Triton kernels against eager and compiled torch (bench/kernels.py)
#   calibrate      the planner's calibration file (bench/gpu_calibrate.py), then
#   plan_calibrated  scripts/plan.py --calibration on it
#   train_kernels  a short bf16 0.4B training run with the Triton kernels on and off, then
#   train_compare  the same loss curve, each one's step time
#   multirank      TP=2 + SP, PP=2, CP=2 (ring), ZeRO-3 in fp32, TP=2 + SP and CP=2 in bf16 as two
#                  ranks sharing the GPU over staged-gloo: collectives and send/recv on host copies
#                  over gloo, compute on the GPU (NCCL refuses two ranks on one GPU; gloo has no
#                  CUDA send/recv), each against one process (scripts/gpu_multirank.py)
#   train_1b       Llama-3.2-1B shape, bf16, kernels on, compiled, against plain PyTorch: tokens/s,
#                  TFLOP/s, MFU; the planner's memory against the measured peak
#   fp8_1b         bf16 and FP8 GEMMs at the 1B shapes, then bf16 and FP8 training (bench/gpu_fp8.py)
# With 2+ GPUs, also (and calibrate then times NCCL collectives):
#   multirank_nccl the same layouts on two GPUs over NCCL (init with device_id, split_group)
#
#   bash scripts/gpu_check.sh [OUT_DIR]           on the GPU (default OUT_DIR: gpu_check/)
#   bash scripts/gpu_check.sh --plan              each part with its estimated seconds, the total
#   bash scripts/gpu_check.sh --smoke [OUT_DIR]   on a CPU: every part's code path at tiny sizes
# PYTHON=... picks the interpreter. GPU_CHECK_ONLY="multirank train_1b" runs only those (the rest
# are reported NOT RUN and the exit status is 1: a part not run is not a pass).
# Every part runs: none is skipped for time. Each has a timeout of 1.5x its estimate + 20 s; a
# part that fails, times out, or reports a skip inside it (a `SKIPPED:` line, pytest's "N skipped")
# fails by name. All results stay in OUT_DIR; OUT_DIR/summary.txt is the one-screen summary.
set -uo pipefail
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODE=gpu
case ${1:-} in
    --plan) MODE=plan; shift ;;
    --smoke) MODE=smoke; shift ;;
esac
PYTHON=${PYTHON:-python3}
LIMIT_S=480  # the loan's 8 minutes
# name, estimated seconds on one H100/H200 (not yet measured there: the first loan's parts.tsv
# gives the real ones), parts needing 2+ GPUs marked "multi".
PLAN="install 35
kernel_tests 35
kernel_bench 25
calibrate 30
plan_calibrated 5
train_kernels_on 28
train_kernels_off 28
train_compare 2
multirank 75
train_1b 120
fp8_1b 90
multirank_nccl 60 multi"
planned() { awk -v n="$1" '$1 == n {print $2}' <<< "$PLAN"; }

if [[ $MODE == plan ]]; then
    gpus=${GPU_CHECK_GPUS:-1}
    awk -v gpus="$gpus" -v limit="$LIMIT_S" '
        $3 == "multi" && gpus < 2 { printf "  %-18s %4d s  (2+ GPUs only, not in the total)\n", $1, $2; next }
        { printf "  %-18s %4d s\n", $1, $2; total += $2 }
        END { printf "total for %d GPU(s): %d s (the 1-GPU loan'"'"'s limit: %d s)\n", gpus, total,
                     limit
              exit gpus < 2 && total > limit }' <<< "$PLAN"
    exit
fi

OUT=$(mkdir -p "${1:-gpu_check}" && cd "${1:-gpu_check}" && pwd)
cd "$REPO_DIR" || exit 1
export PYTHONUNBUFFERED=1
ALL=$(awk '{print $1}' <<< "$PLAN" | tr '\n' ' ')
ONLY=" ${GPU_CHECK_ONLY:-$ALL} "
START=$SECONDS
status=0
rm -rf "$OUT"/*.log "$OUT"/*.txt "$OUT"/*.json "$OUT"/*.jsonl "$OUT/multirank_nccl"
: > "$OUT/parts.tsv"
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(planned "$1")" >> "$OUT/parts.tsv"; }

part() {  # part NAME COMMAND...: runs it within its timeout, logs to $OUT/NAME.log
    local name=$1; shift
    if [[ $ONLY != *" $name "* ]]; then
        record "$name" "NOT RUN (GPU_CHECK_ONLY)" 0; status=1
        return 1
    fi
    local limit=$(( $(planned "$name") * 3 / 2 + 20 ))
    [[ $MODE == smoke ]] && limit=300  # two shared CPU cores, not the GPU the plan is for
    echo "== $name (timeout $limit s): $*"
    local began=$SECONDS
    timeout -k 20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]} took=$((SECONDS - began)) why=""
    local skip
    skip=$(grep -m1 -E '^SKIPPED|[0-9]+ skipped' "$OUT/$name.log")
    if (( rc == 124 || rc == 137 )); then
        why="TIMED OUT after $limit s (planned ~$(planned "$name") s)"
    elif (( rc )); then
        why="FAILED (exit $rc, see $name.log)"
    elif [[ -n $skip ]]; then
        why="FAILED: skipped inside (${skip:0:40})"
    fi
    if [[ -z $why ]]; then
        record "$name" ok "$took"
        return 0
    fi
    echo "== $name $why"
    record "$name" "$why" "$took"; status=1
    return 1
}

if [[ $MODE == gpu ]] && ! nvidia-smi -L > /dev/null 2>&1; then
    echo "no CUDA device visible (nvidia-smi finds none); on a CPU use --smoke"; exit 1
fi
# First, so that a fresh machine has torch and triton for everything after it.
[[ $MODE == smoke ]] && export CUDA_VISIBLE_DEVICES="" PIP_NO_INDEX=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1  # nothing to fetch: the smoke's venv has it all
part install "$PYTHON" -m pip install -q -r requirements.txt
if [[ $MODE == smoke ]]; then
    GPUS=2  # the multi-GPU parts' code path too, over gloo on the CPU
    "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cpu smoke')" | tee "$OUT/device.log"
else
    { nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton',
triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"; } \
        2>&1 | tee "$OUT/device.log"
    "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "no CUDA device visible to $PYTHON"; exit 1; }
    GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
fi
# Each part's arguments: the GPU's sizes, or the smoke's tiny ones through the same code.
BENCH_SMOKE=tests/kernels/test_bench_smoke.py::test_every_benchmark_step_runs_forward_and_backward
PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider -rs)
TRAIN=(--mock-data --vocab-size 32000 --num-layers 8 --hidden-size 2048 --num-attention-heads 16
       --group-query-attention --num-query-groups 4 --ffn-hidden-size 5632 --seq-length 2048
       --micro-batch-size 4 --global-batch-size 8 --bf16)
KTESTS=(tests/kernels --deselect "$BENCH_SMOKE")  # the bench's CPU (interpreter) test
KBENCH=("$PYTHON" bench/kernels.py --dtype bf16 --tokens 8192)
CALIB=() TRAIN1B=(--model 1b --steps 10 --warmup 4)
MULTI=(--iters 10 --timeout 60)  # a hung layout is named before the part's own timeout
FP8=(--model 1b --steps 40 --warmup 10)
if [[ $MODE == smoke ]]; then
    TRAIN=(--mock-data --vocab-size 97 --make-vocab-size-divisible-by 8 --num-layers 2
           --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --seq-length 16
           --micro-batch-size 2 --global-batch-size 4)
    KTESTS+=(-m "not gpu") KBENCH=("${PYTEST[@]}" "$BENCH_SMOKE")
    CALIB=(--device cpu --seq-length 64 --tp 1 2 --copy-mib 4 --seconds 0.02)
    MULTI=(--device cpu --iters 5)
    TRAIN1B=(--model tiny --device cpu --compile-backend eager --steps 4 --warmup 2)
    FP8=(--model tiny --device cpu --steps 3 --warmup 1 --gemm-reps 2)
fi

part kernel_tests "${PYTEST[@]}" "${KTESTS[@]}"
part kernel_bench "${KBENCH[@]}" && [[ $MODE == gpu ]] && cp bench/results/kernels.json "$OUT/"
part calibrate "$PYTHON" bench/gpu_calibrate.py --out "$OUT" "${CALIB[@]}"
part plan_calibrated "$PYTHON" scripts/plan.py --preset 8B --gpus 8 --top 3 --explain \
    --calibration "$OUT/calibration.json"
for mode in on off; do
    part "train_kernels_$mode" "$PYTHON" pretrain.py "${TRAIN[@]}" --train-iters 12 --lr 3e-4 \
        --lr-warmup-iters 3 --lr-decay-style cosine --adam-beta2 0.95 --eval-iters 0 \
        --log-interval 1 --wandb-mode disabled --seed 1 --triton-kernels "$mode" \
        --log-jsonl "$OUT/train_kernels_$mode.jsonl"
done
part train_compare "$PYTHON" - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
runs = {m: [json.loads(line) for line in open(f"{out}/train_kernels_{m}.jsonl")
            if '"loss"' in line] for m in ("on", "off")}
on, off = ([r["loss"] for r in runs[m]] for m in ("on", "off"))
worst = max(abs(a - b) / abs(b) for a, b in zip(on, off))
ms = {m: statistics.median(r["iter_time_ms"] for r in runs[m][4:]) for m in runs}
print(f"losses on/off: first {on[0]:.4f}/{off[0]:.4f} last {on[-1]:.4f}/{off[-1]:.4f}, "
      f"worst relative difference {worst:.2e} (bf16 tolerance 2e-2)")
print(f"median step ms after 4 warm-up steps: kernels on {ms['on']:.1f}, off {ms['off']:.1f} "
      f"(on is {ms['off'] / ms['on']:.3f}x the speed of off)")
sys.exit(0 if len(on) == len(off) == 12 and worst <= 2e-2 else 1)
PY
part multirank "$PYTHON" scripts/gpu_multirank.py --out "$OUT" "${MULTI[@]}"
part train_1b "$PYTHON" bench/gpu_train.py --out "$OUT" "${TRAIN1B[@]}"
part fp8_1b "$PYTHON" bench/gpu_fp8.py --out "$OUT" "${FP8[@]}"
if (( GPUS >= 2 )); then  # on the CPU smoke: the same flow over plain gloo
    part multirank_nccl "$PYTHON" scripts/gpu_multirank.py --out "$OUT/multirank_nccl" \
        --backend "$([[ $MODE == smoke ]] && echo gloo || echo nccl)" "${MULTI[@]}"
fi

{
    echo "gpu_check summary ($MODE): $(date -u '+%Y-%m-%d %H:%M UTC'), git" \
         "$(git describe --always --dirty 2>/dev/null || echo unknown)," \
         "$((SECONDS - START)) s (plan: $LIMIT_S s at most)"
    cat "$OUT/device.log"
    "$PYTHON" bench/gpu_summary.py "$OUT"
} > "$OUT/summary.txt"
echo "======== summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
exit $status
