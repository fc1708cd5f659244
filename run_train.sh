#!/usr/bin/env bash
# Train on this machine's devices through torchrun. Extra arguments are config overrides (--section.key value).
#   NGPU         local processes (default: the number of CUDA devices, or 4 CPU processes without one)
#   CONFIG_FILE  TOML config (default ./train_configs/debug_model.toml)
#   LOG_RANK     comma-separated local ranks whose output is shown (default 0)
#   MAX_RESTARTS torchrun --max-restarts (default 0)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python}
if [ -z "${NGPU:-}" ]; then
  if ls /dev/nvidia[0-9]* /dev/kfd >/dev/null 2>&1; then  # a GPU driver: let torch count (honours CUDA_VISIBLE_DEVICES)
    NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 4)")
  else  # none: skip importing torch just to learn that (~1.5 s of start-up)
    NGPU=4
  fi
fi
CONFIG_FILE=${CONFIG_FILE:-./train_configs/debug_model.toml}
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}
export PYTHONUNBUFFERED=1
# torchrun's agent shares one store with every round of workers (torch >= 2.5): a new node then deadlocks the
# rendezvous, and restarted workers read the dead ones' addresses. Unshared, rank 0 serves a fresh store each round.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# A config every rank would reject alike (a typo, degrees that do not fit NGPU, a missing file) is reported in one
# line by one process before torchrun starts, rather than by rank 0 and then torchrun's failure summary.
WORLD_SIZE=$NGPU "$PYTHON" train.py --check --job.config_file "$CONFIG_FILE" "$@" || exit $?
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" --max-restarts="$MAX_RESTARTS" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  train.py --job.config_file "$CONFIG_FILE" "$@" &
launcher=$!
# Preemption (SIGTERM from Slurm or Kubernetes, SIGUSR1 as Slurm's early warning) goes to the workers, torchrun's
# children: they agree on a step, save it and exit 0, and torchrun with them. Given to torchrun itself, the signal
# would also reach them, but torchrun would report it as a failure (exit 1).
trap 'pkill -TERM -P "$launcher"' TERM
trap 'pkill -USR1 -P "$launcher"' USR1
while true; do
  status=0
  wait "$launcher" || status=$?  # returns early when a trap ran: wait again until torchrun is gone
  kill -0 "$launcher" 2>/dev/null || exit "$status"
done
