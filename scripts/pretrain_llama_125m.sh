#!/bin/bash
#SBATCH --job-name=ml-llama-125m
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --exclusive
#SBATCH --time=02:00:00
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --output=runs/%x-%j.out
#
# Llama-style 125M class, one node of 8 H100/H200 80 GB. Submit from the repository root:
#   DATA_MANIFEST=/shared/data/train.manifest.json TOKENIZER_MODEL=/shared/tok.model \
#   sbatch scripts/pretrain_llama_125m.sh
#
# Model: 12 layers, hidden 768, 12 heads (no GQA), SwiGLU 2048, seq 2048, tied embeddings,
#   vocab 32000 assumed below (the tokenizer sets it). 110 M parameters, all in matmuls once
#   the tied output layer is counted.
# Tokens: 2.5 B (20 per parameter). FLOPs per token: 6 x 0.110e9 + 12 x 12 x 768 x 2048
#   = 0.88 GFLOP, 2.2e18 in total: 12 minutes on 8 GPUs at 40% MFU of 989 TFLOP/s (a model this
#   small reaches less; 20% doubles it).
# Layout: pure data parallelism, TP=1 PP=1 DP=8. Per GPU the states are 110 M x 18 B = 2 GB;
#   activations 34*s*b*h = 0.86 GB per layer x 12 = 10 GB at micro-batch 16, fp32 logits 4 GB.
#   Splitting the model would only add communication. Global batch 256 x 2048 = 0.5 M tokens per
#   step, 2 micro-batches per rank; 4,768 steps.
# Signals: USR1 arrives 120 s before the time limit so training saves a checkpoint and exits;
#   --requeue puts the job back in the queue after a node failure or preemption.

RUN_NAME=llama-125m
REPO_DIR=${MEGATRON_LITE_DIR:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
source "$REPO_DIR/scripts/common.sh"

TP=${TP:-1} PP=${PP:-1} MBS=${MBS:-16} GBS=${GBS:-256} TRAIN_ITERS=${TRAIN_ITERS:-4768}

MODEL_ARGS=(--num-layers 12 --hidden-size 768 --num-attention-heads 12
            --ffn-hidden-size 2048 --seq-length 2048 --max-position-embeddings 2048 --bf16)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
               --use-distributed-optimizer --overlap-grad-reduce --distributed-timeout-minutes 10)
DATA_ARGS=(--data-path "$(ml_staged_data_path)"
           --tokenizer-model "${TOKENIZER_MODEL:-$REPO_DIR/tokenizer.model}"
           --data-sharding node-local --split 969,30,1 --num-workers 2)
TRAINING_ARGS=(--micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS"
               --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 200 --lr-decay-style cosine
               --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
               --init-method-std 0.02 --eval-interval 500 --eval-iters 10 --seed 1234)
# Per-rank parallel saves; every job of the run (same CKPT_DIR) resumes from `latest`. Slurm's
# USR1 (--signal above) makes every rank save at the same iteration and exit 0.
CHECKPOINT_ARGS=(--save "$CKPT_DIR" --save-interval 1000
                 --save-interval-minutes 60 --save-keep-last 3 --async-save
                 --hang-timeout-seconds 1800)
LOGGING_ARGS=(--log-interval 10 --log-jsonl "$RUN_DIR/metrics.jsonl"
              --wandb-project "${WANDB_PROJECT:-megatron_lite}" --wandb-exp-name "$RUN_NAME-$JOB_ID"
              --wandb-save-dir "$RUN_DIR")

ml_launch
