#!/usr/bin/env bash
# Reproduce nanoGPT's CPU Shakespeare-char result (README: validation loss 1.88 after 2000
# iterations in about 3 minutes) with our Llama-style model, end to end:
#   1. train a sentencepiece `char` tokenizer on Tiny Shakespeare,
#   2. split the text at nanoGPT's boundary (first 90% of the characters train, last 10%
#      validate) and preprocess both parts into one shard, one document each, so that
#      `--split 1,1,0` makes document 0 the training set and document 1 the validation set,
#   3. train nanoGPT's configuration: 4 layers, 4 heads, width 128, context 64, batch 12,
#      2000 iterations, lr 1e-3 cosine to 1e-4 after 100 warm-up iterations, AdamW beta2 0.99,
#      weight decay 0.1, clip 1.0, no dropout (we have none), seed 1337,
#   4. print the validation loss (nats per character over 200 x 12 x 64 held-out tokens), the
#      wall time and the training tokens/s.
#
# Usage: bash scripts/shakespeare_char_cpu.sh [--input PATH] [--out DIR] [pretrain.py flags]
#   --input   Tiny Shakespeare text (default: ../shared/data/tinyshakespeare/input.txt next
#             to the repo); when it is missing the script says so and exits 0.
#   --out     work directory (default: runs/shakespeare_char, gitignored); the tokenizer and
#             shards are reused on a rerun.
#   --fp32    train in fp32 (default: the CPU's fastest matmul dtype, bf16 where it is native)
#   Any other flags go to pretrain.py after ours, so they override them, e.g.
#   `--bf16 --compile` (the fastest CPU setting, see bench/shakespeare.py) or
#   `--train-iters 100` for a quick look.
# On a CPU shared with other jobs, OMP_NUM_THREADS=1 avoids oversubscribed OpenMP threads
# (2 threads per process with other processes on the cores ran ~20x slower here).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
INPUT="$REPO/../shared/data/tinyshakespeare/input.txt"
OUT="$REPO/runs/shakespeare_char"
EXTRA=()
DTYPE=auto
while [[ $# -gt 0 ]]; do
    case "$1" in
        --input) INPUT=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --fp32) DTYPE=fp32; shift ;;
        *) EXTRA+=("$1"); shift ;;
    esac
done
if [[ ! -f "$INPUT" ]]; then
    echo "skipping: Tiny Shakespeare not found at $INPUT (pass --input PATH; nanoGPT's" \
         "data/shakespeare_char/prepare.py names where to download it)"
    exit 0
fi
mkdir -p "$OUT"
if [[ $DTYPE == auto && " ${EXTRA[*]} " != *" --bf16 "* ]]; then
    # the CPU's fastest matmul dtype: bf16 where it is native, fp32 where it is emulated
    DTYPE_FLAG=$("$PYTHON" -m megatron_lite.devices --cpu-dtype-flag)
    echo "dtype: ${DTYPE_FLAG:-fp32} (this CPU's fastest matmul; --fp32 for fp32)"
    if [[ -n $DTYPE_FLAG ]]; then EXTRA=("$DTYPE_FLAG" "${EXTRA[@]}"); fi
fi

if [[ ! -f "$OUT/char.model" ]]; then
    # char pieces for every character of the text (coverage 1.0), so each character is one
    # token and the loss per token is the loss per character, as in nanoGPT
    "$PYTHON" -m tokenizer.train --input "$INPUT" --output-prefix "$OUT/char" \
        --model-type char --vocab-size 512 --character-coverage 1.0
fi
if [[ ! -f "$OUT/shakespeare.manifest.json" ]]; then
    "$PYTHON" - "$INPUT" "$OUT" <<'EOF'
import sys
from pathlib import Path

text = Path(sys.argv[1]).read_text(encoding="utf-8")
n = int(len(text) * 0.9)  # nanoGPT's prepare.py: train = data[:n], val = data[n:]
out = Path(sys.argv[2])
(out / "0_train.txt").write_text(text[:n], encoding="utf-8")
(out / "1_valid.txt").write_text(text[n:], encoding="utf-8")
print(f"split {len(text):,} characters: {n:,} train, {len(text) - n:,} validation")
EOF
    "$PYTHON" -m data_tools.preprocess --input "$OUT/0_train.txt" "$OUT/1_valid.txt" \
        --output-prefix "$OUT/shakespeare" --tokenizer-model "$OUT/char.model" --workers 1
    rm -f "$OUT/0_train.txt" "$OUT/1_valid.txt"
fi
VOCAB=$("$PYTHON" -c "import sys; from tokenizer.tokenizer import Tokenizer; \
print(Tokenizer(sys.argv[1]).vocab_size)" "$OUT/char.model")

METRICS="$OUT/metrics.jsonl"
rm -f "$METRICS"
START=$(date +%s.%N)
"$PYTHON" pretrain.py --data-path "$OUT/shakespeare" --tokenizer-model "$OUT/char.model" \
    --vocab-size "$VOCAB" --split 1,1,0 --data-cache-path "$OUT/cache" \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 384 \
    --seq-length 64 --micro-batch-size 12 --train-iters 2000 --seed 1337 \
    --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 100 --lr-decay-style cosine \
    --adam-beta1 0.9 --adam-beta2 0.99 --weight-decay 0.1 --clip-grad 1.0 \
    --eval-interval 500 --eval-iters 200 --log-interval 1 --log-jsonl "$METRICS" \
    "${EXTRA[@]}" | awk '/^iter / { if ($2 + 0 > 1 && ($2 + 0) % 100) next }
                           !/^[ {}]/ { print; fflush() }'
END=$(date +%s.%N)

"$PYTHON" - "$METRICS" "$START" "$END" <<'EOF'
import json
import statistics
import sys

records = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in records if "tokens_per_sec" in r]
evals = [r for r in records if "eval_loss" in r]
wall = float(sys.argv[3]) - float(sys.argv[2])
tokens = train[0]["tokens_per_sec"] * train[0]["iter_time_ms"] / 1e3  # per iteration
times = [r["iter_time_ms"] / 1e3 for r in train[10:]]  # after warm-up / compilation
final = evals[-1]
print(f"validation loss at iteration {final['iteration']}: {final['eval_loss']:.4f} nats/char "
      f"(nanoGPT README: 1.88; target <= 1.88)")
print("validation curve: " + ", ".join(f"{r['iteration']}: {r['eval_loss']:.4f}" for r in evals))
print(f"wall time {wall:.1f} s (the whole pretrain.py run: startup, compilation, training, "
      f"evaluations)")
print(f"training: {tokens / statistics.median(times):,.0f} tok/s at the median iteration "
      f"({1e3 * statistics.median(times):.1f} ms), {tokens * len(times) / sum(times):,.0f} tok/s "
      f"on average, over iterations 11-{len(train)}")
EOF
