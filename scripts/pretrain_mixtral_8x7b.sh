#!/bin/bash
#SBATCH --job-name=ml-mixtral-8x7b
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
# Mixtral-8x7B-like mixture of experts, 64 GPUs (8 nodes x 8 H100/H200 80 GB). Submit from the
# repository root:
#   DATA_MANIFEST=/shared/data/train.manifest.json TOKENIZER_MODEL=/shared/tok.model \
#   sbatch scripts/pretrain_mixtral_8x7b.sh
# Check the layout first, without a GPU: DRY_RUN="0 63" bash scripts/pretrain_mixtral_8x7b.sh
# The job resubmits itself (sbatch --dependency=afterany:<job>, up to MAX_RESUBMITS) after the
# time limit, a preemption or a failure, and restarts in place after a crash (MAX_RESTARTS);
# every job of the run shares runs/<RUN_NAME> and resumes from its checkpoint (common.sh).
#
# Model: 32 layers, hidden 4096, 32 heads, 8 KV groups (GQA), every MLP a mixture of 8 SwiGLU
#   experts of width 14336 with top-2 routing (softmax, aux loss 0.01), seq 4096, untied
#   embeddings, RoPE base 1e6, vocab 32000 assumed below (the tokenizer sets it). 46.7 B
#   parameters, 12.9 B active per token (planner.moe_total_params).
# Tokens: 258 B (20 per active parameter). Layout: from scripts/plan.py (--num-layers 32
#   --hidden-size 4096 --num-attention-heads 32 --num-query-groups 8 --ffn-hidden-size 14336
#   --seq-length 4096 --vocab-size 32000 --untie-embeddings-and-output-weights
#   --global-batch-size 512 --gpus 64 --num-experts 8 --moe-router-topk 2
#   --moe-token-dispatcher-type alltoall), its #6: TP=1, PP=2 across nodes with the
#   interleaved schedule (v=4 chunks of 4 layers per stage), DP=32 with EP=8 carved out of it
#   (one node's 8 GPUs hold one expert each, so the all-to-all dispatch stays on NVLink),
#   expert-DP=4, ZeRO-1 over DP (dense) and over expert-DP (experts). Per GPU: 16 layers of
#   0.05 B dense + 0.18 B expert parameters (+ embedding or head) x (2 B bf16 + 4 B fp32
#   grad), master + Adam 12 B/param over 32 (dense) and 4 (experts): 28.4 GiB of states,
#   39.4 GiB of activations (the routed rows: top-2 x (3h + 3f) per token per layer),
#   70.8 GiB of 80 with the allowance, no recompute. Micro-batch 1 x 4096 tokens, global 512
#   sequences = 2.1 M tokens per step, 16 micro-batches per pipeline; 123,021 steps; the
#   planner predicts 6.08 s per step (1.5% bubble, 43% MFU on the active parameters), 8.6
#   days. Faster on paper: #1-#4, ZeRO-3 over all 64 ranks with full recompute (5.81 s),
#   which lean on hiding two parameter gathers per micro-batch across nodes, and #5, ZBV
#   (6.07 s); this one recomputes nothing and gathers no parameters in the step.
# Signals: USR1 arrives 120 s before the time limit so training saves a checkpoint and exits;
#   --requeue puts the job back in the queue after a node failure or preemption.
# Checkpoints keep each EP rank's experts in their own files and reshard to any EP size.

RUN_NAME=mixtral-8x7b
REPO_DIR=${MEGATRON_LITE_DIR:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
source "$REPO_DIR/scripts/common.sh"

TP=${TP:-1} PP=${PP:-2} VPP=${VPP:-4} EP=${EP:-8} MBS=${MBS:-1} GBS=${GBS:-512} TRAIN_ITERS=${TRAIN_ITERS:-123021}

MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32
            --group-query-attention --num-query-groups 8
            --ffn-hidden-size 14336 --seq-length 4096 --max-position-embeddings 4096
            --rotary-base 1000000 --untie-embeddings-and-output-weights --bf16
            --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 14336
            --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01
            --moe-router-dtype fp32 --moe-token-dispatcher-type alltoall)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
               --num-layers-per-virtual-pipeline-stage "$VPP" --expert-model-parallel-size "$EP"
               --use-distributed-optimizer --overlap-grad-reduce
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
