#!/bin/bash
# Every check that needs a CUDA GPU, in one run, with the results in one folder: the kernel tests
# on the device (with the real-size `gpu` ones), the kernel benchmark, and a short bf16 training
# run with the Triton kernels on and off (same loss curve, and each one's step time).
#   bash scripts/gpu_check.sh [OUT_DIR]        (default: gpu_check/; PYTHON=... to pick python)
# About 5-8 minutes on one H100/H200. It keeps going past a failed part and exits non-zero at the
# end if any part failed.
set -uo pipefail
REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(mkdir -p "${1:-gpu_check}" && cd "${1:-gpu_check}" && pwd)
PYTHON=${PYTHON:-python3}
cd "$REPO_DIR" || exit 1
export PYTHONUNBUFFERED=1
status=0
part() {  # part NAME COMMAND...: runs it, logs to $OUT/NAME.log, records failure
    local name=$1; shift
    echo "== $name: $*"
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    [[ $rc -eq 0 ]] || { echo "== $name FAILED (exit $rc)"; status=1; }
}

{ nvidia-smi -L; "$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'triton',
triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"; } \
    2>&1 | tee "$OUT/device.log"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "no CUDA device visible to $PYTHON"; exit 1; }

part kernel_tests "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels
part kernel_bench "$PYTHON" bench/kernels.py --dtype bf16 --tokens 8192
cp bench/results/kernels.json "$OUT/" 2>/dev/null

# ~0.4B-parameter Llama on mock data: 20 steps each way.
TRAIN=(--mock-data --vocab-size 32000 --num-layers 8 --hidden-size 2048 --num-attention-heads 16
       --num-query-groups 4 --ffn-hidden-size 5632 --seq-length 2048 --micro-batch-size 4
       --global-batch-size 8 --train-iters 20 --lr 3e-4 --lr-warmup-iters 5 --bf16
       --eval-iters 0 --log-interval 1 --wandb-mode disabled --seed 1)
for mode in on off; do
    part "train_kernels_$mode" "$PYTHON" pretrain.py "${TRAIN[@]}" --triton-kernels "$mode" \
        --log-jsonl "$OUT/train_kernels_$mode.jsonl"
done
part train_compare "$PYTHON" - "$OUT" <<'PY'
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
echo "results in $OUT"
exit $status
