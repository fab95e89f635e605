# Sourced by the batch scripts in this folder: every knob is an environment variable with a default.
#   REPO_DIR         the ulysses-train checkout                  (default: the sbatch submit directory)
#   NPROC_PER_NODE   ranks per node                               (default: GPUs Slurm gave the node, else 1)
#   OUTPUT_DIR       checkpoints and metrics.jsonl; stable across requeues of the job
#                                                                 (default: $REPO_DIR/outputs/<job name>-<job id>)
#   LOG_DIR          per-job logs: environment, per-rank logs     (default: $REPO_DIR/logs/<job name>-<job id>)
#   MASTER_PORT      rendezvous port on the first node            (default: 29500 + job id % 1000)
#   DS_CONFIG        DeepSpeed config                             (default: ds_configs/zero3.json)
#   TRAIN_ARGS       extra launch/train.py flags                  (default: none); arguments after the script
#                    name on the sbatch line are appended too
#   PYTHON           interpreter                                  (default: python3)
set -euo pipefail
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$REPO_DIR"
JOB_TAG="${SLURM_JOB_NAME:-ulysses}-${SLURM_JOB_ID:-0}"
gpus_on_node=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}
gpus_on_node=${gpus_on_node##*:}  # "h100:8" -> "8"
NPROC_PER_NODE=${NPROC_PER_NODE:-${gpus_on_node:-1}}
OUTPUT_DIR=${OUTPUT_DIR:-$REPO_DIR/outputs/$JOB_TAG}
LOG_DIR=${LOG_DIR:-$REPO_DIR/logs/$JOB_TAG}
DS_CONFIG=${DS_CONFIG:-ds_configs/zero3.json}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUTPUT_DIR" "$LOG_DIR"
NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
export MASTER_ADDR=${MASTER_ADDR:-${NODES[0]}}
export MASTER_PORT=${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}
NNODES=${#NODES[@]}

# NCCL and the allocator: fail fast on a dead peer instead of hanging, expandable segments against fragmentation
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1

# Preemption and the time limit: Slurm sends SIGTERM to the job steps (preemption) or, with --signal=B:USR1@T, USR1
# to this script T seconds before the time limit. Either way the trainer saves and exits 0; on USR1 we also requeue,
# and the requeued job (same job id, same OUTPUT_DIR) resumes through --resume auto.
requeue_and_stop() {
  echo "$(date -Is) USR1: requeueing job $SLURM_JOB_ID and asking the trainer to save" | tee -a "$LOG_DIR/events.log"
  scontrol requeue "$SLURM_JOB_ID" || true
  scancel --signal=TERM "$SLURM_JOB_ID" || true
}
trap requeue_and_stop USR1

TRAIN=(launch/train.py --ds_config "$DS_CONFIG" --output_dir "$OUTPUT_DIR" --resume auto ${TRAIN_ARGS:-} "$@")
{ echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on ${NODES[*]}: $NNODES nodes x $NPROC_PER_NODE ranks";
  echo "master $MASTER_ADDR:$MASTER_PORT"; echo "train: ${TRAIN[*]}"; } | tee -a "$LOG_DIR/events.log"
env | grep -E '^(SLURM|NCCL|TORCH|MASTER|CUDA)' | sort > "$LOG_DIR/env-${SLURM_RESTART_COUNT:-0}.txt"

run_and_wait() {  # runs "$@" in the background so the USR1 trap can fire, and returns its exit status
  "$@" &
  local pid=$!
  while true; do
    wait "$pid" && return 0
    local rc=$?
    kill -0 "$pid" 2>/dev/null || return "$rc"  # wait returns early when a trapped signal arrives
  done
}
