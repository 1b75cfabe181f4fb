#!/bin/bash
# A tiny Llama on this machine's CPUs: 2 processes under torchrun --standalone, TP=2 with sequence
# parallelism, gloo. It exercises the same launch path and flags as the cluster scripts in about a
# minute. Mock data by default; set DATA_PATH (shard prefix or manifest) and TOKENIZER_MODEL to
# train on real shards. Override NPROC, TP, TRAIN_ITERS, DTYPE (auto: bf16 where the CPU multiplies
# it natively, else fp32; or fp32, bf16), EXTRA_ARGS as needed:
#   bash scripts/pretrain_llama_tiny_cpu.sh
#   TRAIN_ITERS=200 DATA_PATH=demo/shards/train.manifest.json \
#     TOKENIZER_MODEL=demo/tokenizer.model bash scripts/pretrain_llama_tiny_cpu.sh
#
# Model: 4 layers, hidden 128, 4 heads, 2 KV groups, seq 128; a few hundred thousand parameters.

RUN_NAME=llama-tiny-cpu
REPO_DIR=${MEGATRON_LITE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
LAUNCHER=${LAUNCHER:-local}
GPUS_PER_NODE=${NPROC:-2}
source "$REPO_DIR/scripts/common.sh"

TP=${TP:-2} MBS=${MBS:-4} GBS=${GBS:-8} TRAIN_ITERS=${TRAIN_ITERS:-30}

MODEL_ARGS=(--num-layers 4 --hidden-size 128 --num-attention-heads 4
            --group-query-attention --num-query-groups 2
            --ffn-hidden-size 384 --seq-length 128)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --sequence-parallel --distributed-backend gloo
               --distributed-timeout-minutes 2)
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}")
else
    DATA_ARGS=(--mock-data --vocab-size 512)
fi
TRAINING_ARGS=(--micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS"
               --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 5 --lr-decay-style cosine
               --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
               --eval-interval 10 --eval-iters 2 --seed 1234)
# Saved every 10 iterations: a second run of this script resumes from `latest`.
# DTYPE=auto (default): the CPU's fastest matmul dtype, bf16 where native; DTYPE=fp32|bf16
case "${DTYPE:-auto}" in
    auto) DTYPE_FLAG=$(cd "$REPO_DIR" && "$PYTHON" -m megatron_lite.devices --cpu-dtype-flag) ;;
    bf16) DTYPE_FLAG=--bf16 ;;
    fp32) DTYPE_FLAG="" ;;
    *) echo "error: DTYPE=$DTYPE: use auto, fp32 or bf16" >&2; exit 2 ;;
esac
if [[ -n $DTYPE_FLAG ]]; then TRAINING_ARGS+=("$DTYPE_FLAG"); fi
CHECKPOINT_ARGS=(--save "$CKPT_DIR" --save-interval 10)
LOGGING_ARGS=(--log-interval 5 --log-jsonl "$RUN_DIR/metrics.jsonl" --wandb-mode disabled)

ml_launch
