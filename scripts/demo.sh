#!/usr/bin/env bash
# The real data path end to end, on any machine, with no download:
#   1. train a sentencepiece tokenizer on the Python standard library's .py sources,
#   2. preprocess them into Megatron .bin/.idx shards plus a manifest,
#   3. train a small Llama on the CPU for a few minutes, evaluating on the held-out split,
#   4. save a checkpoint and generate text from it.
# Usage: bash scripts/demo.sh [--quick] [--moe] [--fp32|--bf16|--fp8] [--help]   (--quick: a few
# iterations, for CI; the dtype defaults to the CPU's fastest matmul, bf16 where native;
# --moe: the same model with 8 experts of half the MLP width, top-2, in every layer: the same
# active parameters and FLOPs per token, outputs under demo/moe_*)
# Outputs go to demo/ (gitignored); a rerun reuses the tokenizer and shards found there.
set -euo pipefail
if [[ " $* " == *" --help "* ]]; then  # before the set-up, which may create .venv
    echo "usage: bash scripts/demo.sh [--quick] [--moe] [--fp32 | --bf16 | --fp8]   (--quick: a" \
         "few iterations, for CI; --moe: 8 experts top-2 at the dense model's active size;" \
         "default dtype: this CPU's fastest matmul (bf16 where native, else fp32);" \
         "--fp32/--bf16: that dtype; --fp8: bf16 with FP8 GEMMs, --fp8-format hybrid;" \
         "DEMO_ITERS=N: N iterations instead of 600; outputs in demo/)"
    exit 0
fi
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"   # creates .venv on first use; cds to the repo
PYTHON=${PYTHON:-python}
QUICK=0
[[ " $* " == *" --quick "* ]] && QUICK=1
RUN=""       # output name prefix
MODEL=()     # flags beyond the dense demo's
if [[ " $* " == *" --moe "* ]]; then
    RUN=moe_
    # top-2 of 8 experts of half the MLP width: x2 restores a whole MLP's output scale
    MODEL=(--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256
           --moe-router-topk-scaling-factor 2 --moe-aux-loss-coeff 1e-3)
fi
if [[ " $* " == *" --fp8 "* ]]; then
    RUN=${RUN}fp8_
    MODEL+=(--bf16 --fp8-format hybrid)  # Megatron's default recipe, delayed
elif [[ " $* " == *" --bf16 "* ]]; then
    RUN=${RUN}bf16_
    MODEL+=(--bf16)
elif [[ " $* " != *" --fp32 "* ]]; then
    # neither asked: the CPU's fastest matmul dtype (bf16 where it is native: ~1.5x per step on
    # an AVX-512 BF16 EPYC; fp32 where bf16 is emulated, ~10-1000x slower)
    DTYPE_FLAG=$("$PYTHON" -m megatron_lite.devices --cpu-dtype-flag)
    echo "demo: ${DTYPE_FLAG:-fp32 (--fp32)} is this CPU's fastest matmul dtype (--fp32 or --bf16 to choose)"
    [[ -n $DTYPE_FLAG ]] && MODEL+=("$DTYPE_FLAG")
fi
OUT=demo
VOCAB=4096
mkdir -p "$OUT"

STDLIB=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
mapfile -t FILES < <(find "$STDLIB" -name '*.py' -not -path '*/site-packages/*' \
    -not -path '*/test/*' -not -path '*/tests/*' | LC_ALL=C sort)
echo "corpus: ${#FILES[@]} .py files under $STDLIB"

if [[ ! -f "$OUT/tok.model" ]]; then
    "$PYTHON" -m tokenizer.train --input "${FILES[@]}" --output-prefix "$OUT/tok" \
        --vocab-size "$VOCAB" --input-sentence-size 500000
else
    echo "reusing $OUT/tok.model"
fi

if [[ ! -f "$OUT/stdlib.manifest.json" ]]; then
    "$PYTHON" -m data_tools.preprocess --input "${FILES[@]}" --output-prefix "$OUT/stdlib" \
        --tokenizer-model "$OUT/tok.model" --num-shards 2 --append-eod
else
    echo "reusing $OUT/stdlib.manifest.json"
fi

ITERS=${DEMO_ITERS:-600}
EVAL_INTERVAL=200
LOG_INTERVAL=10
if [[ $QUICK == 1 ]]; then ITERS=10; EVAL_INTERVAL=5; LOG_INTERVAL=1; fi
rm -rf "$OUT/${RUN}ckpt" "$OUT/${RUN}metrics.jsonl"  # a fresh run each time (a kept checkpoint would be resumed)
"$PYTHON" pretrain.py --data-path "$OUT/stdlib" --tokenizer-model "$OUT/tok.model" \
    --split 98,2,0 \
    --num-layers 4 --hidden-size 192 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 16 --train-iters "$ITERS" --lr 2e-3 --min-lr 2e-4 \
    --lr-decay-style cosine --adam-beta2 0.95 --lr-warmup-iters 20 --eval-interval "$EVAL_INTERVAL" --eval-iters 4 --log-interval "$LOG_INTERVAL" \
    "${MODEL[@]}" --log-jsonl "$OUT/${RUN}metrics.jsonl" --save "$OUT/${RUN}ckpt"

"$PYTHON" - "$OUT/${RUN}metrics.jsonl" "$VOCAB" <<'PY'
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
train = [r["loss"] for r in rows if "loss" in r]
evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
print(f"demo: train loss {train[0]:.3f} -> {train[-1]:.3f} (ln vocab = "
      f"{math.log(int(sys.argv[2])):.3f}); held-out eval loss {evals[-1]:.3f}")
PY

# 4. sample from the trained model (the checkpoint gathered onto one process)
"$PYTHON" scripts/generate.py --load "$OUT/${RUN}ckpt" --tokenizer-model "$OUT/tok.model" \
    --prompt "def " --max-new-tokens 48 --top-k 8 --seed 0
