#!/bin/bash
#SBATCH --job-name=ml-llama-1b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --exclusive
#SBATCH --time=12:00:00
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --output=runs/%x-%j.out
#
# Llama-3.2-1B shape, 16 GPUs (2 nodes x 8 H100/H200 80 GB). Submit from the repository root:
#   DATA_MANIFEST=/shared/data/train.manifest.json TOKENIZER_MODEL=/shared/tok.model \
#   sbatch scripts/pretrain_llama_1b.sh
#
# Model: 16 layers, hidden 2048, 32 heads, 8 KV groups (GQA), SwiGLU 8192, seq 4096, tied
#   embeddings, vocab 32000 assumed below (the tokenizer sets it). 1.04 B parameters, all in
#   matmuls once the tied output layer is counted.
# Tokens: 20 B (20 per parameter). FLOPs per token: 6 x 1.04e9 + 12 x 16 x 2048 x 4096
#   = 7.8 GFLOP, 1.6e20 in total: 6.9 hours on 16 GPUs at 40% MFU of 989 TFLOP/s.
# Layout: TP=1 PP=1 DP=16 with ZeRO-1. Per GPU: 1.04 B x (2 B bf16 weight + 4 B fp32 grad) =
#   6.2 GB, master + Adam 12 B/param over DP=16 = 0.8 GB; activations 34*s*b*h = 1.1 GB per layer
#   x 16 = 18 GB at micro-batch 4, fp32 logits 2 GB: about 28 GB of 80, so neither TP nor
#   recompute is needed, and DP across the two nodes is one gradient reduce-scatter per step,
#   overlapped with the backward. Global batch 256 x 4096 = 1 M tokens per step, 4 micro-batches
#   per rank; 19,073 steps.
# Signals: USR1 arrives 120 s before the time limit so training saves a checkpoint and exits;
#   --requeue puts the job back in the queue after a node failure or preemption.

RUN_NAME=llama-1b
REPO_DIR=${MEGATRON_LITE_DIR:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
source "$REPO_DIR/scripts/common.sh"

TP=${TP:-1} PP=${PP:-1} MBS=${MBS:-4} GBS=${GBS:-256} TRAIN_ITERS=${TRAIN_ITERS:-19073}

MODEL_ARGS=(--num-layers 16 --hidden-size 2048 --num-attention-heads 32
            --group-query-attention --num-query-groups 8
            --ffn-hidden-size 8192 --seq-length 4096 --max-position-embeddings 4096
            --rotary-base 500000 --bf16)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
               --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
               --distributed-timeout-minutes 10)
DATA_ARGS=(--data-path "$(ml_staged_data_path)"
           --tokenizer-model "${TOKENIZER_MODEL:-$REPO_DIR/tokenizer.model}"
           --data-sharding node-local --split 969,30,1 --num-workers 2)
TRAINING_ARGS=(--micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS"
               --lr 4e-4 --min-lr 4e-5 --lr-warmup-iters 1000 --lr-decay-style cosine
               --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
               --init-method-std 0.02 --eval-interval 1000 --eval-iters 10 --seed 1234)
# Per-rank parallel saves; every job of the run (same CKPT_DIR) resumes from `latest`. Slurm's
# USR1 (--signal above) makes every rank save at the same iteration and exit 0.
CHECKPOINT_ARGS=(--save "$CKPT_DIR" --save-interval 1000
                 --save-interval-minutes 60 --save-keep-last 3 --async-save
                 --hang-timeout-seconds 1800)
LOGGING_ARGS=(--log-interval 10 --log-jsonl "$RUN_DIR/metrics.jsonl"
              --wandb-project "${WANDB_PROJECT:-megatron_lite}" --wandb-exp-name "$RUN_NAME-$JOB_ID"
              --wandb-save-dir "$RUN_DIR")

ml_launch
