#!/bin/bash
#SBATCH --job-name=ml-llama-8b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --output=runs/%x-%j.out
#
# Llama-3-8B shape, 64 GPUs (8 nodes x 8 H100/H200 80 GB). Submit from the repository root:
#   DATA_MANIFEST=/shared/data/train.manifest.json TOKENIZER_MODEL=/shared/tok.model \
#   sbatch scripts/pretrain_llama_8b.sh
# The job resubmits itself (sbatch --dependency=afterany:<job>, up to MAX_RESUBMITS) after the
# time limit, a preemption or a failure, and restarts in place after a crash (MAX_RESTARTS);
# every job of the run shares runs/<RUN_NAME> and resumes from its checkpoint (common.sh).
#
# Model: 32 layers, hidden 4096, 32 heads, 8 KV groups (GQA), SwiGLU 14336, seq 8192, untied
#   embeddings, vocab 128256 assumed below (the tokenizer sets it). 8.03 B parameters, 7.50 B of
#   them in matmuls (output layer included, input embedding not).
# Tokens: 160 B (20 per parameter). FLOPs per token: 6 x 7.50e9 + 12 x 32 x 4096 x 8192
#   = 57.9 GFLOP, 9.27e21 in total: 4.2 days on 64 GPUs at 40% MFU of 989 TFLOP/s.
# Layout (sizes from the Korthikanti et al. formulas the planner uses; check with scripts/plan.py):
#   TP=2 inside a node (NVLink) with sequence parallelism, PP=1, DP=32, ZeRO-1.
#   Per GPU: 4.0 B parameters x (2 B bf16 weight + 4 B fp32 grad) = 24 GB, fp32 master + Adam
#   12 B/param sharded over DP=32 = 1.5 GB; activations 34*s*b*h/t = 570 MB per layer x 32 =
#   18 GB (SDPA never stores the s^2 scores); fp32 logits 2 GB. About 46 GB of 80: no recompute.
#   TP=1 would need 48 GB of states plus 36 GB of activations: over 80 GB without recompute.
#   Micro-batch 1 x 8192 tokens, global 128 sequences = 1 M tokens per step, 4 micro-batches per
#   DP rank per step; 152,588 steps; about 2.4 s per step at 40% MFU.
# Signals: USR1 arrives 120 s before the time limit so training saves a checkpoint and exits;
#   --requeue puts the job back in the queue after a node failure or preemption.

RUN_NAME=llama-8b
REPO_DIR=${MEGATRON_LITE_DIR:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
source "$REPO_DIR/scripts/common.sh"

TP=${TP:-2} PP=${PP:-1} MBS=${MBS:-1} GBS=${GBS:-128} TRAIN_ITERS=${TRAIN_ITERS:-152588}

MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32
            --group-query-attention --num-query-groups 8
            --ffn-hidden-size 14336 --seq-length 8192 --max-position-embeddings 8192
            --rotary-base 500000 --untie-embeddings-and-output-weights --bf16)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
               --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce
               --overlap-param-gather --distributed-timeout-minutes 10)
DATA_ARGS=(--data-path "$(ml_staged_data_path)"
           --tokenizer-model "${TOKENIZER_MODEL:-$REPO_DIR/tokenizer.model}"
           --data-sharding node-local --split 969,30,1 --num-workers 2)
TRAINING_ARGS=(--micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS"
               --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000 --lr-decay-style cosine
               --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
               --init-method-std 0.02 --eval-interval 1000 --eval-iters 10 --seed 1234)
# Per-rank parallel saves; every job of the run (same CKPT_DIR) resumes from `latest`. Slurm's
# USR1 (--signal above) makes every rank save at the same iteration and exit 0.
CHECKPOINT_ARGS=(--save "$CKPT_DIR" --save-interval 500
                 --save-interval-minutes 60 --save-keep-last 3 --async-save
                 --hang-timeout-seconds 1800)
LOGGING_ARGS=(--log-interval 10 --log-jsonl "$RUN_DIR/metrics.jsonl"
              --wandb-project "${WANDB_PROJECT:-megatron_lite}" --wandb-exp-name "$RUN_NAME-$JOB_ID"
              --wandb-save-dir "$RUN_DIR")

ml_launch
