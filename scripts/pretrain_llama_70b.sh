#!/bin/bash
#SBATCH --job-name=ml-llama-70b
#SBATCH --nodes=128
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --output=runs/%x-%j.out
#
# Llama-3-70B shape, 1,024 GPUs (128 nodes x 8 H100/H200 80 GB). Submit from the repository root:
#   DATA_MANIFEST=/shared/data/train.manifest.json TOKENIZER_MODEL=/shared/tok.model \
#   sbatch scripts/pretrain_llama_70b.sh
# The job resubmits itself (sbatch --dependency=afterany:<job>, up to MAX_RESUBMITS) after the
# time limit, a preemption or a failure, and restarts in place after a crash (MAX_RESTARTS);
# every job of the run shares runs/<RUN_NAME> and resumes from its checkpoint (common.sh).
#
# Model: 80 layers, hidden 8192, 64 heads, 8 KV groups (GQA), SwiGLU 28672, seq 4096, untied
#   embeddings, vocab 128256 assumed below (the tokenizer sets it). 70.6 B parameters, 69.5 B of
#   them in matmuls (output layer included, input embedding not).
# Tokens: 1.4 T (20 per parameter). FLOPs per token: 6 x 69.5e9 + 12 x 80 x 8192 x 4096
#   = 449 GFLOP, 6.3e23 in total: 18 days on 1,024 GPUs at 40% MFU of 989 TFLOP/s.
# Layout: the textbook 70B-on-1,024 layout: TP=8 inside a node (NVLink, sequence parallel),
#   PP=8 across nodes with the interleaved schedule (v=5 chunks of 2 layers per stage), DP=16,
#   ZeRO-1. Per GPU: 1.1 B parameters x 6 B = 6.6 GB, master + Adam over DP=16 = 0.8 GB;
#   activations 34*s*b*h/t = 143 MB per layer, 10 layers x 8 in-flight micro-batches on the first
#   stage (+7/40 for interleaving) = 13 GB: about 21 GB of 80, so no recompute. TP=8 keeps every
#   TP collective on NVLink; fewer stages would need recompute, more would grow the bubble.
#   Global batch 1024 x 4096 = 4 M tokens per step, 64 micro-batches per pipeline per step, so the
#   bubble is (p-1)/(v*m) = 7/320 = 2.2%; 333,786 steps.
# Signals: USR1 arrives 120 s before the time limit so training saves a checkpoint and exits;
#   --requeue puts the job back in the queue after a node failure or preemption.

RUN_NAME=llama-70b
REPO_DIR=${MEGATRON_LITE_DIR:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
source "$REPO_DIR/scripts/common.sh"

TP=${TP:-8} PP=${PP:-8} VP_LAYERS=${VP_LAYERS:-2} MBS=${MBS:-1} GBS=${GBS:-1024}
TRAIN_ITERS=${TRAIN_ITERS:-333786}

MODEL_ARGS=(--num-layers 80 --hidden-size 8192 --num-attention-heads 64
            --group-query-attention --num-query-groups 8
            --ffn-hidden-size 28672 --seq-length 4096 --max-position-embeddings 4096
            --rotary-base 500000 --untie-embeddings-and-output-weights --bf16)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
               --num-layers-per-virtual-pipeline-stage "$VP_LAYERS" --sequence-parallel
               --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
               --distributed-timeout-minutes 10)
DATA_ARGS=(--data-path "$(ml_staged_data_path)"
           --tokenizer-model "${TOKENIZER_MODEL:-$REPO_DIR/tokenizer.model}"
           --data-sharding node-local --split 969,30,1 --num-workers 2)
TRAINING_ARGS=(--micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS"
               --lr 1.5e-4 --min-lr 1.5e-5 --lr-warmup-iters 2000 --lr-decay-style cosine
               --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
               --init-method-std 0.008 --eval-interval 1000 --eval-iters 10 --seed 1234)
# Per-rank parallel saves; every job of the run (same CKPT_DIR) resumes from `latest`. Slurm's
# USR1 (--signal above) makes every rank save at the same iteration and exit 0.
CHECKPOINT_ARGS=(--save "$CKPT_DIR" --save-interval 250
                 --save-interval-minutes 60 --save-keep-last 3 --async-save
                 --hang-timeout-seconds 1800)
LOGGING_ARGS=(--log-interval 10 --log-jsonl "$RUN_DIR/metrics.jsonl"
              --wandb-project "${WANDB_PROJECT:-megatron_lite}" --wandb-exp-name "$RUN_NAME-$JOB_ID"
              --wandb-save-dir "$RUN_DIR")

ml_launch
