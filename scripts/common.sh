# shellcheck shell=bash
# What the pretrain_*.sh launch scripts share: paths, Python, NCCL defaults, run logging, node-local
# data staging, the tiny-size override used by tests, and the launch itself.
#
# Source it after setting REPO_DIR and RUN_NAME; each script then fills the bash arrays
#   MODEL_ARGS PARALLEL_ARGS DATA_ARGS TRAINING_ARGS CHECKPOINT_ARGS LOGGING_ARGS
# and calls `ml_launch`. Every variable below can be overridden from the environment:
#   PYTHON            interpreter (default: $REPO_DIR/.venv/bin/python, else python3)
#   LAUNCHER          srun (one task per GPU, default) | torchrun (one torchrun per node under
#                     srun) | local (torchrun --standalone on this machine, no Slurm)
#   GPUS_PER_NODE     GPUs per node (default: Slurm's tasks per node, else 8)
#   DATA_MANIFEST     shared-storage manifest to stage onto node-local disk before training
#   LOCAL_DATA_DIR    node-local directory for the staged shards (default: /tmp/$USER/data)
#   RUN_DIR           logs and the JSONL metrics of this run (default: runs/<name>-<job id>)
#   EXTRA_ARGS        appended to the pretrain.py command line, word-split
#   MEGATRON_LITE_TINY=1  replace the model/batch/data arrays with a tiny CPU configuration
#                     (mock data, gloo, 2 iterations) so tests can run any script on localhost
#   DRY_RUN="R ..."   no Slurm, no data, no GPU: run ranks R (or `all`) of this script's full
#                     layout on the meta device (pretrain.py --dry-run), e.g.
#                     DRY_RUN="0 7 1023" bash scripts/pretrain_llama_70b.sh
#   WORLD_SIZE        with DRY_RUN: ranks of the job (default: #SBATCH --nodes x GPUS_PER_NODE)
#   VOCAB_SIZE        with DRY_RUN and no TOKENIZER_MODEL file: the vocabulary (default 128256)

set -euo pipefail

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO_DIR/.venv/bin/python" ]]; then PYTHON="$REPO_DIR/.venv/bin/python"
    else PYTHON=python3; fi
fi
LAUNCHER=${LAUNCHER:-srun}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-8}}
NNODES=${SLURM_NNODES:-1}
LOCAL_DATA_DIR=${LOCAL_DATA_DIR:-/tmp/${USER:-megatron_lite}/data}
JOB_ID=${SLURM_JOB_ID:-local}
RUN_DIR=${RUN_DIR:-$REPO_DIR/runs/$RUN_NAME-$JOB_ID}
MODEL_ARGS=() PARALLEL_ARGS=() DATA_ARGS=() TRAINING_ARGS=() CHECKPOINT_ARGS=() LOGGING_ARGS=()

# NCCL and PyTorch settings. `:=` keeps anything the user exported.
ml_nccl_env() {
    # Orders kernel launches so TP/SP communication overlaps compute the way Megatron expects.
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    # WARN prints init failures and fabric errors without flooding the log; use INFO to debug.
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    # A hung or failed collective tears the process down instead of spinning forever, and the
    # flight recorder dumps each rank's last collectives so the hang can be located.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
    export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-20000}
    export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
    export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-$RUN_DIR/comm_traces/rank_}
    # Fabric tuning is site-specific; check the cluster's docs before setting e.g.
    # NCCL_IB_TIMEOUT (retry timeout, 4.096 us x 2^N) or NCCL_IB_SL (service level).
    # Fragmentation in long runs with varying activation shapes.
    export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
    # Python stack of every thread on a fatal signal (segfault in a kernel, NCCL abort).
    export PYTHONFAULTHANDLER=1
    # Triton compiles into a per-node cache; a shared-filesystem cache thrashes at scale.
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/${USER:-megatron_lite}/triton_${SLURM_NODEID:-0}}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    # Uncomment for the NIC that carries NCCL/gloo traffic when autodetection picks the wrong one:
    # export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0
}

# Enough to reproduce the run from its log: commit, versions, hosts and the environment.
ml_log_run_info() {
    mkdir -p "$RUN_DIR/comm_traces"
    {
        echo "date: $(date -u +%FT%TZ)"
        echo "git: $(git -C "$REPO_DIR" rev-parse HEAD 2>/dev/null || echo unknown)"
        echo "git dirty: $(git -C "$REPO_DIR" status --porcelain 2>/dev/null | wc -l) files"
        "$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)'
        echo "job: $JOB_ID nodes: ${SLURM_JOB_NODELIST:-$(hostname)} launcher: $LAUNCHER"
        command -v nvidia-smi >/dev/null && nvidia-smi -L
        env | grep -E '^(SLURM|NCCL|TORCH|CUDA|MASTER|WANDB_MODE|OMP|PYTORCH)' | sort
    } | tee "$RUN_DIR/run_info.txt"
}

# Tests and dry runs: keep each script's structure, swap in sizes a CPU runs in seconds.
ml_tiny_override() {
    [[ "${MEGATRON_LITE_TINY:-0}" == 1 ]] || return 0
    echo "MEGATRON_LITE_TINY=1: tiny model, mock data, gloo"
    MODEL_ARGS=(--num-layers 2 --hidden-size 64 --num-attention-heads 4
                --group-query-attention --num-query-groups 2
                --ffn-hidden-size 192 --seq-length 32 --vocab-size 250)
    PARALLEL_ARGS=(--tensor-model-parallel-size "${TINY_TP:-2}" --sequence-parallel
                   --distributed-backend gloo --distributed-timeout-minutes 1)
    DATA_ARGS=(--mock-data)
    TRAINING_ARGS=(--micro-batch-size 2 --train-iters "${TINY_ITERS:-2}" --lr 1e-3 --seed 1234
                   --lr-decay-style cosine --adam-beta2 0.95 --eval-iters 1)
    CHECKPOINT_ARGS=()
    LOGGING_ARGS=(--log-interval 1 --log-jsonl "$RUN_DIR/metrics.jsonl" --wandb-mode disabled
                  --peak-tflops 1)
    DATA_MANIFEST=""
}

# Copy each node's shards from shared storage to local disk, one task per node, before training.
ml_stage_data() {
    [[ -n "${DATA_MANIFEST:-}" ]] || return 0
    # The step has one task per node, so the training layout is passed explicitly: each node
    # copies the shards of the data-parallel ranks that will run on it.
    srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
        "$PYTHON" -m data_tools.stage --manifest "$DATA_MANIFEST" --local-dir "$LOCAL_DATA_DIR" \
        --gpus-per-node "$GPUS_PER_NODE" --tensor-model-parallel-size "${TP:-1}" \
        --pipeline-model-parallel-size "${PP:-1}"
}

# Rendezvous for LAUNCHER=torchrun. With srun the ranks derive the same values themselves
# (megatron_lite/parallel/launch.py): first host of the node list as IPv4, port from the job id.
ml_master_env() {
    local head
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    MASTER_ADDR=${MASTER_ADDR:-$(getent ahostsv4 "$head" | awk 'NR==1{print $1}')}
    MASTER_PORT=${MASTER_PORT:-$((10000 + SLURM_JOB_ID % 50000))}
    export MASTER_ADDR MASTER_PORT
}

# The script's layout, checked rank by rank on the meta device instead of launched.
ml_dry_run() {
    local nodes world vocab=(--vocab-size "${VOCAB_SIZE:-128256}")
    nodes=$(sed -n 's/^#SBATCH --nodes=\([0-9]*\).*/\1/p' "$0")
    world=${WORLD_SIZE:-$(( ${nodes:-1} * GPUS_PER_NODE ))}
    [[ -f "${TOKENIZER_MODEL:-}" ]] && vocab=(--tokenizer-model "$TOKENIZER_MODEL")
    local args=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${vocab[@]}")
    # shellcheck disable=SC2206  # DRY_RUN and EXTRA_ARGS are meant to be word-split
    args+=(--dry-run --world-size "$world" --dry-run-ranks ${DRY_RUN} ${EXTRA_ARGS:-})
    cd "$REPO_DIR"
    exec "$PYTHON" pretrain.py "${args[@]}"
}

ml_launch() {
    if [[ -n "${DRY_RUN:-}" ]]; then ml_dry_run; fi
    ml_tiny_override
    ml_nccl_env
    ml_log_run_info
    ml_stage_data
    local args=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}"
                "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}")
    # shellcheck disable=SC2206  # EXTRA_ARGS is meant to be word-split
    args+=(${EXTRA_ARGS:-})
    cd "$REPO_DIR"
    if [[ "$LAUNCHER" == local ]]; then
        # One machine, no Slurm: torchrun --standalone picks a free port itself.
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$GPUS_PER_NODE" \
            pretrain.py "${args[@]}" 2>&1 | tee -a "$RUN_DIR/train.log"
    elif [[ "$LAUNCHER" == torchrun ]]; then
        ml_master_env
        # One torchrun per node; the node rank is fixed from Slurm so ranks match LAUNCHER=srun.
        srun --ntasks-per-node=1 --kill-on-bad-exit=1 --wait=60 bash -c \
            "exec \"$PYTHON\" -m torch.distributed.run --nnodes=$NNODES \
            --nproc-per-node=$GPUS_PER_NODE --node-rank=\$SLURM_NODEID \
            --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT --max-restarts=0 \
            --signals-to-handle=SIGTERM,SIGINT,SIGUSR1 pretrain.py ${args[*]@Q}" \
            2>&1 | tee -a "$RUN_DIR/train.log"
    else
        # One task per GPU; --kill-on-bad-exit ends the step when one rank dies instead of letting
        # the others wait out the collective timeout.
        srun --kill-on-bad-exit=1 --wait=60 "$PYTHON" -u pretrain.py "${args[@]}" \
            2>&1 | tee -a "$RUN_DIR/train.log"
    fi
}

# Where training reads the staged data: DATA_PATH if given, else the staged prefix on local disk
# (stage copies OUT.manifest.json and its shards, so LOCAL_DATA_DIR/OUT is a valid --data-path).
ml_staged_data_path() {
    local manifest=${DATA_MANIFEST:-train.manifest.json}
    echo "${DATA_PATH:-$LOCAL_DATA_DIR/$(basename "${manifest%.manifest.json}")}"
}
