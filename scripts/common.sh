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
#   RUNS_DIR          where runs live (default: $REPO_DIR/runs)
#   RUN_DIR           this run: checkpoints, one train.log and one metrics.jsonl that every job
#                     of the run appends to, run_info.txt, exclude_hosts (default:
#                     $RUNS_DIR/<RUN_NAME>, the same for every job, so a chained, requeued or
#                     resubmitted job resumes from the checkpoint `latest`)
#   CKPT_DIR          checkpoints (default: $RUN_DIR/checkpoints)
#   MAX_RESTARTS      in-place relaunches after a crash within one job (default 1)
#   MAX_RESUBMITS     self-resubmissions of the run (sbatch --dependency=afterany:<job>) after a
#                     time-limit/preemption exit or a failure; counted over the whole run
#                     (default 10; 0 = never). Failing hosts are passed to --exclude. A failure
#                     repeated at the same iteration stops both.
#   PREFLIGHT         off | quick: each node checks its GPUs before the rendezvous (pretrain.py
#                     --preflight; default quick)
#   SITE              the fabric profile scripts/site/$SITE.env (NCCL interface, address family,
#                     IB HCAs); SITE_ENV=FILE for one elsewhere
#   EXTRA_ARGS        appended to the pretrain.py command line, word-split
#   MEGATRON_LITE_TINY=1  replace the model/batch/data arrays with a tiny CPU configuration
#                     (mock data, gloo, 2 iterations) so tests can run any script on localhost
#   DRY_RUN="R ..."   no Slurm, no shard read, no GPU: run ranks R (or `all`) of this script's
#                     full layout on the meta device (pretrain.py --dry-run) with its data,
#                     checkpoint and logging flags (paths checked: DATA_MANIFEST or DATA_PATH,
#                     TOKENIZER_MODEL, the save and log directories), e.g.
#                     DRY_RUN="0 7 1023" bash scripts/pretrain_llama_70b.sh
#   WORLD_SIZE        with DRY_RUN: ranks of the job (default: #SBATCH --nodes x GPUS_PER_NODE)
#   VOCAB_SIZE        with DRY_RUN and no TOKENIZER_MODEL: the vocabulary (default 128256)
#   DRY_RUN_JSONL     with DRY_RUN: its per-rank records (default RUN_DIR/dry_run.jsonl)

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
JOB_START=${JOB_START:-${SLURM_JOB_START_TIME:-$(date +%s)}}
RUNS_DIR=${RUNS_DIR:-$REPO_DIR/runs}
RUN_DIR=${RUN_DIR:-$RUNS_DIR/$RUN_NAME}
CKPT_DIR=${CKPT_DIR:-$RUN_DIR/checkpoints}
MAX_RESTARTS=${MAX_RESTARTS:-1}
MAX_RESUBMITS=${MAX_RESUBMITS:-10}
PREFLIGHT=${PREFLIGHT:-quick}
# What a resubmission submits again. Under Slurm $0 is the spool copy of the batch script; it
# exists until the job ends, and sbatch reads it at submission.
ML_SCRIPT=${ML_SCRIPT:-$(realpath "$0")}
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
    # The fabric (NIC, address family, IB HCAs) is the site's: see scripts/site/example.env.
    local site=${SITE_ENV:-${SITE:+$REPO_DIR/scripts/site/$SITE.env}}
    if [[ -n "$site" ]]; then
        [[ -f "$site" ]] || { echo "error: SITE/SITE_ENV: no file $site (copy \
scripts/site/example.env)" >&2; exit 2; }
        echo "fabric profile: $site"
        # shellcheck disable=SC1090
        source "$site"
    fi
    # Multi-node: NCCL's NET lines at INFO say which transport it chose (IB, a net plugin, or
    # plain TCP sockets); ml_watch_transport records it and warns on sockets.
    if (( NNODES > 1 )) && [[ "$NCCL_DEBUG" == WARN ]]; then
        export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-NET}
    fi
}

# The transport NCCL chose ("NCCL INFO Using network IB" / "Socket"), from the run log, into
# run_info.txt; a multi-node job on plain sockets warns (a fraction of the fabric's bandwidth).
# Runs in the background from the launch and gives up after TRANSPORT_WAIT_S seconds.
ml_watch_transport() {
    local log=$1 from=$2 waited=0 net
    while (( waited < ${TRANSPORT_WAIT_S:-900} )); do
        net=$(tail -c +"$((from + 1))" "$log" 2>/dev/null \
              | sed -n 's/.*NCCL INFO Using network \([A-Za-z_0-9]*\).*/\1/p' | head -n 1)
        if [[ -n "$net" ]]; then
            echo "nccl transport: $net (job $JOB_ID)" >> "$RUN_DIR/run_info.txt"
            if (( NNODES > 1 )) && [[ "$net" == Socket ]]; then
                echo "warning: NCCL runs this $NNODES-node job over plain TCP sockets, not \
InfiniBand/RoCE or a net plugin (EFA): expect a fraction of the fabric's bandwidth. Set the \
site's fabric profile (SITE=..., scripts/site/example.env) or check NCCL_IB_HCA / \
NCCL_SOCKET_IFNAME." >> "$log"
            fi
            return 0
        fi
        sleep 2
        waited=$((waited + 2))
    done
}

# Enough to reproduce the run from its log: commit, versions, hosts and the environment.
ml_log_run_info() {
    mkdir -p "$RUN_DIR/comm_traces"
    {
        echo "date: $(date -u +%FT%TZ)"
        echo "git: $(git -C "$REPO_DIR" rev-parse HEAD 2>/dev/null || echo unknown)"
        echo "git dirty: $(git -C "$REPO_DIR" status --porcelain 2>/dev/null | wc -l) files"
        # the installed version without importing torch (seconds on a busy login node)
        "$PYTHON" -c 'import sys, importlib.metadata as m
print("python", sys.version.split()[0], "torch", m.version("torch"))'
        echo "job: $JOB_ID nodes: ${SLURM_JOB_NODELIST:-$(hostname)} launcher: $LAUNCHER"
        command -v nvidia-smi >/dev/null && nvidia-smi -L
        env | grep -E '^(SLURM|NCCL|TORCH|CUDA|MASTER|WANDB_MODE|OMP|PYTORCH|GLOO)' | sort
    } | tee "$RUN_DIR/run_info.txt"
    if (( NNODES > 1 )) && [[ -z "${NCCL_NET:-}${NCCL_NET_PLUGIN:-}${FI_PROVIDER:-}" ]] \
            && ! compgen -G "/sys/class/infiniband/*" >/dev/null; then
        echo "warning: a $NNODES-node job, and this node has no InfiniBand/RoCE device \
(/sys/class/infiniband is empty) and no net plugin is set: NCCL will fall back to TCP sockets"
    fi
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
    LOGGING_ARGS=(--log-interval 1 --log-jsonl "$RUN_DIR/metrics.jsonl" --wandb-mode disabled
                  --peak-tflops 1)
    CHECKPOINT_ARGS=(--save "$CKPT_DIR" --save-interval "${TINY_SAVE_INTERVAL:-5}")
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

# The data flags as a dry run checks them (existence only, no shard read; an array in
# DRY_DATA_ARGS): the staged node-local --data-path becomes the shared DATA_MANIFEST it is
# staged from (a node-local run reads that manifest, its shards are on the nodes' disks), a
# DATA_PATH stays as given, and with neither the dry run reads mock batches and says so. The
# tokenizer flag stays (and is checked) when TOKENIZER_MODEL is set, else --vocab-size VOCAB_SIZE.
ml_dry_run_data() {
    local i=0 pair
    DRY_DATA_ARGS=()
    while (( i < ${#DATA_ARGS[@]} )); do
        pair=("${DATA_ARGS[@]:i:2}")
        case "${pair[0]}" in
            --data-path)
                if [[ -n "${DATA_PATH:-}" ]]; then DRY_DATA_ARGS+=("${pair[@]}")
                elif [[ -n "${DATA_MANIFEST:-}" ]]; then
                    DRY_DATA_ARGS+=(--data-path "$DATA_MANIFEST")
                else
                    echo "DRY_RUN: no DATA_MANIFEST or DATA_PATH: mock batches, no data path" \
                         "checked"
                    DRY_DATA_ARGS+=(--mock-data)
                fi
                i=$((i + 2)) ;;
            --tokenizer-model)
                if [[ -n "${TOKENIZER_MODEL:-}" ]]; then DRY_DATA_ARGS+=("${pair[@]}")
                else DRY_DATA_ARGS+=(--vocab-size "${VOCAB_SIZE:-128256}"); fi
                i=$((i + 2)) ;;
            *) DRY_DATA_ARGS+=("${pair[0]}"); i=$((i + 1)) ;;
        esac
    done
}

# The script's layout, checked rank by rank on the meta device instead of launched, with its
# data, checkpoint and logging flags: the paths are checked, the save (--async-save included)
# is assembled on meta into a scratch directory, and the dry run's records go to
# DRY_RUN_JSONL (default RUN_DIR/dry_run.jsonl), never over the run's metrics.jsonl.
ml_dry_run() {
    local nodes world
    nodes=$(sed -n 's/^#SBATCH --nodes=\([0-9]*\).*/\1/p' "$0")
    world=${WORLD_SIZE:-$(( ${nodes:-1} * GPUS_PER_NODE ))}
    ml_dry_run_data
    local args=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DRY_DATA_ARGS[@]}"
                "${TRAINING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}"
                --log-jsonl "${DRY_RUN_JSONL:-$RUN_DIR/dry_run.jsonl}")
    # shellcheck disable=SC2206  # DRY_RUN and EXTRA_ARGS are meant to be word-split
    args+=(--dry-run --world-size "$world" --dry-run-ranks ${DRY_RUN} ${EXTRA_ARGS:-})
    cd "$REPO_DIR"
    exec "$PYTHON" pretrain.py "${args[@]}"
}

# One launch of the training step; returns its exit status (the pipe's first command).
ml_run_once() {
    if [[ "$LAUNCHER" == local ]]; then
        # One machine, no Slurm: torchrun --standalone picks a free port itself.
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$GPUS_PER_NODE" \
            pretrain.py "$@" 2>&1 | tee -a "$RUN_DIR/train.log"
    elif [[ "$LAUNCHER" == torchrun ]]; then
        ml_master_env
        # One torchrun per node; the node rank is fixed from Slurm so ranks match LAUNCHER=srun.
        srun --ntasks-per-node=1 --kill-on-bad-exit=1 --wait=60 bash -c \
            "exec \"$PYTHON\" -m torch.distributed.run --nnodes=$NNODES \
            --nproc-per-node=$GPUS_PER_NODE --node-rank=\$SLURM_NODEID \
            --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT --max-restarts=0 \
            --signals-to-handle=SIGTERM,SIGINT,SIGUSR1 pretrain.py ${*@Q}" \
            2>&1 | tee -a "$RUN_DIR/train.log"
    else
        # One task per GPU; --kill-on-bad-exit ends the step when one rank dies instead of letting
        # the others wait out the collective timeout.
        srun --kill-on-bad-exit=1 --wait=60 "$PYTHON" -u pretrain.py "$@" \
            2>&1 | tee -a "$RUN_DIR/train.log"
    fi
    return "${PIPESTATUS[0]}"
}

# Submit this script again after this job (any exit state), without the failing hosts.
ml_resubmit() {
    local exclude=$1 opts=(--dependency="afterany:$SLURM_JOB_ID")
    [[ -n "$exclude" ]] && opts+=(--exclude="$exclude")
    echo "unattended: sbatch ${opts[*]} $ML_SCRIPT" | tee -a "$RUN_DIR/train.log"
    # the next job resolves its own rendezvous on its own nodes
    env -u MASTER_ADDR -u MASTER_PORT sbatch "${opts[@]}" "$ML_SCRIPT" 2>&1 \
        | tee -a "$RUN_DIR/train.log"
}

# Launch, then let megatron_lite/unattended.py decide: restart in place after a crash (up to
# MAX_RESTARTS), resubmit (time limit, preemption, a failing host, restarts used up; up to
# MAX_RESUBMITS over the run) or stop (done, a failure repeated at one iteration). The job's
# exit status is the last launch's.
ml_launch() {
    if [[ -n "${DRY_RUN:-}" ]]; then ml_dry_run; fi
    ml_tiny_override
    ml_nccl_env
    ml_log_run_info
    ml_stage_data
    local args=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}"
                "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}" --preflight "$PREFLIGHT")
    # shellcheck disable=SC2206  # EXTRA_ARGS is meant to be word-split
    args+=(${EXTRA_ARGS:-})
    cd "$REPO_DIR"
    export MEGATRON_LITE_JOURNAL=1  # training's train_end record, read by after-launch
    local restarts=0 rc lines offset decision watcher no_resubmit=()
    [[ -n "${SLURM_JOB_ID:-}" ]] || no_resubmit=(--no-resubmit)
    # Slurm's SIGTERM at the time limit (or a preemption) reaches the tasks; this shell keeps
    # going so it can resubmit.
    trap 'echo "unattended: SIGTERM to the batch shell; waiting for the training step"' TERM
    while true; do
        touch "$RUN_DIR/train.log"
        lines=$( (cat "$RUN_DIR/metrics.jsonl" 2>/dev/null || true) | wc -l)
        offset=$(stat -c %s "$RUN_DIR/train.log")
        ml_watch_transport "$RUN_DIR/train.log" "$offset" >/dev/null 2>&1 & watcher=$!
        set +e
        ml_run_once "${args[@]}"
        rc=$?
        set -e
        kill "$watcher" 2>/dev/null || true
        decision=$("$PYTHON" -m megatron_lite.unattended after-launch --run-dir "$RUN_DIR" \
            --rc "$rc" --from-line "$lines" --log-offset "$offset" --restarts "$restarts" \
            --max-restarts "$MAX_RESTARTS" --max-resubmits "$MAX_RESUBMITS" \
            --job-start "$JOB_START" "${no_resubmit[@]}")
        if [[ "$decision" == restart ]]; then
            restarts=$((restarts + 1))
            continue
        fi
        if [[ "$decision" == resubmit* ]]; then
            local hosts=${decision#resubmit}
            ml_resubmit "${hosts# }"
        fi
        return "$rc"
    done
}

# Where training reads the staged data: DATA_PATH if given, else the staged prefix on local disk
# (stage copies OUT.manifest.json and its shards, so LOCAL_DATA_DIR/OUT is a valid --data-path).
ml_staged_data_path() {
    local manifest=${DATA_MANIFEST:-train.manifest.json}
    echo "${DATA_PATH:-$LOCAL_DATA_DIR/$(basename "${manifest%.manifest.json}")}"
}
