#!/bin/bash
# Every check that needs a CUDA GPU, in one run, with the results in one folder:
#   kernel_tests   the kernel tests on the device (with the real-size `gpu` ones)
#   kernel_bench   the kernel benchmark (bench/kernels.py)
#   calibrate      the planner's calibration file (bench/gpu_calibrate.py): GEMMs of the 8B
#                  preset's shapes at TP 1-8, copy bandwidth, kernel cost, and collectives' bus
#                  bandwidth when there are 2+ GPUs; then scripts/plan.py --calibration on it
#   train_kernels  a short bf16 training run with the Triton kernels on and off (same loss curve,
#                  each one's step time)
#   multirank      two ranks sharing the GPU over cuda:gloo: TP=2 + SP, PP=2, CP=2 (ring
#                  attention) and ZeRO-3 in fp32, TP=2 + SP and CP=2 (the memory-efficient
#                  ring kernels) in bf16, against one process (scripts/gpu_multirank.py); a
#                  skipped layout fails the part (exit 3), a check that proves nothing is no pass
#   train_1b       Llama-3.2-1B shape, seq 4096, bf16, kernels on, compiled: ours against plain
#                  PyTorch (tokens/s, TFLOP/s, MFU), planner memory against the measured peak
#   train_3b       the same at the Llama-3.2-3B shape (bench/gpu_train.py)
#   fp8            bench/gpu_fp8.py at the 1B and 3B shapes: each projection's GEMM in bf16, in
#                  torch._scaled_mm and with the FP8 casts (TFLOP/s); then 200 steps of bf16 and
#                  of --fp8-format hybrid training: tokens/s, MFU, both losses over the same steps
#   bash scripts/gpu_check.sh [OUT_DIR]        (default: gpu_check/; PYTHON=... to pick python)
# OUT_DIR/summary.txt ends the run with every number. The parts run in the order above within a
# time budget (GPU_CHECK_BUDGET_S, default 480 s): each is cut off when the budget runs out, and
# one that would not fit in what is left is skipped and says so. GPU_CHECK_ONLY="multirank
# train_1b" runs only those parts. It keeps going past a failed part and exits non-zero at the
# end if any part failed or timed out.
set -uo pipefail
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(mkdir -p "${1:-gpu_check}" && cd "${1:-gpu_check}" && pwd)
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
ONLY=" ${GPU_CHECK_ONLY:-kernel_tests kernel_bench calibrate train_kernels multirank train_1b train_3b fp8} "
cd "$REPO_DIR" || exit 1
export PYTHONUNBUFFERED=1
START=$SECONDS
status=0
: > "$OUT/parts.tsv"
rm -f "$OUT/summary.txt" "$OUT/multirank.txt" "$OUT/gpu_train_1b.txt" "$OUT/gpu_train_3b.txt" \
    "$OUT/calibration.txt" "$OUT/calibration.json" \
    "$OUT/gpu_fp8_1b.txt" "$OUT/gpu_fp8_3b.txt"
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$OUT/parts.tsv"; }

part() {  # part NAME GROUP NEED_S COMMAND...: runs it within the budget, logs to $OUT/NAME.log
    local name=$1 group=$2 need=$3; shift 3
    rm -f "$OUT/$name.log"
    if [[ $ONLY != *" $group "* ]]; then
        record "$name" "not selected (GPU_CHECK_ONLY)" 0
        return 1
    fi
    local left=$((BUDGET - (SECONDS - START)))
    if (( left < need )); then
        echo "== $name skipped: $left s of the $BUDGET s budget left, it needs ~$need s"
        record "$name" "skipped: time budget ($left s left, needs ~$need s)" 0
        return 1
    fi
    echo "== $name: $*"
    local began=$SECONDS
    timeout -k 20 "$left" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]} took=$((SECONDS - began))
    if (( rc == 0 )); then
        record "$name" ok "$took"
        return 0
    fi
    status=1
    if (( rc == 124 )); then
        echo "== $name TIMED OUT at the end of the budget"
        record "$name" "TIMED OUT at the end of the budget" "$took"
    elif (( rc == 137 )); then
        echo "== $name KILLED (SIGKILL: 20 s past the budget, or out of host memory)"
        record "$name" "KILLED (SIGKILL: past the budget, or out of host memory)" "$took"
    else
        echo "== $name FAILED (exit $rc)"
        record "$name" "FAILED (exit $rc)" "$took"
    fi
    return 1
}

{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton',
triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"; } \
    2>&1 | tee "$OUT/device.log"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "no CUDA device visible to $PYTHON"; exit 1; }

part kernel_tests kernel_tests 30 "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels
part kernel_bench kernel_bench 30 "$PYTHON" bench/kernels.py --dtype bf16 --tokens 8192 \
    && cp bench/results/kernels.json "$OUT/"

part calibrate calibrate 40 "$PYTHON" bench/gpu_calibrate.py --out "$OUT" \
    && part plan_calibrated calibrate 0 "$PYTHON" scripts/plan.py --preset 8B --gpus 8 \
        --top 3 --explain --calibration "$OUT/calibration.json"

# ~0.4B-parameter Llama on mock data: 20 steps each way.
TRAIN=(--mock-data --vocab-size 32000 --num-layers 8 --hidden-size 2048 --num-attention-heads 16
       --group-query-attention --num-query-groups 4 --ffn-hidden-size 5632 --seq-length 2048 --micro-batch-size 4
       --global-batch-size 8 --train-iters 20 --lr 3e-4 --lr-warmup-iters 5
       --lr-decay-style cosine --adam-beta2 0.95 --bf16 --eval-iters 0 --log-interval 1 --wandb-mode disabled --seed 1)
ran_both=1
for mode in on off; do
    rm -f "$OUT/train_kernels_$mode.jsonl"  # the logger appends
    part "train_kernels_$mode" train_kernels 40 "$PYTHON" pretrain.py "${TRAIN[@]}" \
        --triton-kernels "$mode" --log-jsonl "$OUT/train_kernels_$mode.jsonl" || ran_both=0
done
(( ran_both )) && part train_compare train_kernels 0 "$PYTHON" - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
runs = {m: [json.loads(line) for line in open(f"{out}/train_kernels_{m}.jsonl")
            if '"loss"' in line] for m in ("on", "off")}
on, off = ([r["loss"] for r in runs[m]] for m in ("on", "off"))
worst = max(abs(a - b) / abs(b) for a, b in zip(on, off))
ms = {m: statistics.median(r["iter_time_ms"] for r in runs[m][5:]) for m in runs}
print(f"losses on/off: first {on[0]:.4f}/{off[0]:.4f} last {on[-1]:.4f}/{off[-1]:.4f}, "
      f"worst relative difference {worst:.2e} (bf16 tolerance 2e-2)")
print(f"median step ms after 5 warm-up steps: kernels on {ms['on']:.1f}, off {ms['off']:.1f} "
      f"(on is {ms['off'] / ms['on']:.3f}x the speed of off)")
sys.exit(0 if len(on) == len(off) == 20 and worst <= 2e-2 else 1)
PY

part multirank multirank 90 "$PYTHON" scripts/gpu_multirank.py --out "$OUT"
part train_1b train_1b 150 "$PYTHON" bench/gpu_train.py --model 1b --out "$OUT"
part train_3b train_3b 200 "$PYTHON" bench/gpu_train.py --model 3b --out "$OUT"
part fp8_1b fp8 150 "$PYTHON" bench/gpu_fp8.py --model 1b --out "$OUT"
part fp8_3b fp8 200 "$PYTHON" bench/gpu_fp8.py --model 3b --out "$OUT"

{
    echo "gpu_check summary: $(date -u '+%Y-%m-%d %H:%M UTC'), git" \
         "$(git describe --always --dirty 2>/dev/null || echo unknown)," \
         "$((SECONDS - START)) s of a $BUDGET s budget"
    cat "$OUT/device.log"
    echo "parts (status, seconds):"
    awk -F'\t' '{printf "  %-20s %-58s %5s\n", $1, $2, $3}' "$OUT/parts.tsv"
    if [[ -s $OUT/kernel_tests.log ]]; then
        echo "kernel tests:"
        grep -E '^(FAILED|ERROR) ' "$OUT/kernel_tests.log" | sed 's/^/  /'
        tail -n 1 "$OUT/kernel_tests.log" | sed 's/^/  /'
    fi
    if [[ -s $OUT/kernel_bench.log ]]; then
        echo "kernel bench:"
        grep -v '^wrote ' "$OUT/kernel_bench.log" | sed 's/^/  /'
    fi
    cat "$OUT/calibration.txt" 2>/dev/null
    if [[ -s $OUT/plan_calibrated.log ]]; then
        echo "planner with that calibration (8B on 8 GPUs, #1's step):"
        sed -n '/^step time of #1/,$p' "$OUT/plan_calibrated.log" | sed 's/^/  /'
    fi
    if [[ -s $OUT/train_compare.log ]]; then
        echo "Triton kernels on vs off (0.4B, bf16, 20 steps):"
        sed 's/^/  /' "$OUT/train_compare.log"
    fi
    cat "$OUT/multirank.txt" "$OUT/gpu_train_1b.txt" "$OUT/gpu_train_3b.txt" \
        "$OUT/gpu_fp8_1b.txt" "$OUT/gpu_fp8_3b.txt" 2>/dev/null
} > "$OUT/summary.txt"
echo "======== summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
exit $status
