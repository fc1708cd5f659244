#!/usr/bin/env bash
# Train on this machine's devices through torchrun. Extra arguments are config overrides (--section.key value).
#   NGPU         local processes (default: the number of CUDA devices, or 4 CPU processes without one)
#   CONFIG_FILE  TOML config (default: this repository's train_configs/debug_model.toml)
#   LOG_RANK     comma-separated local ranks whose output is shown (default 0)
#   MAX_RESTARTS torchrun --max-restarts (default 0); with REPLICA_GROUPS, the restarts of each group (default 3)
#   REPLICA_GROUPS  train one run as this many replica groups of NGPU processes each, which outlive each other's
#                failures (docs/fault_tolerance.md#replica-groups; torchtitan_lite/runtime/replica_launcher.py)
#   PYTHON       the interpreter (default: python, else python3)
set -euo pipefail
# Paths typed on the command line (CONFIG_FILE too) are files seen from here, where the user stands; the trainer
# resolves them against this directory (torchtitan_lite/config/paths.py), the configs' own against the repository.
export TORCHTITAN_LITE_CALLER_DIR=$PWD
if [ -n "${CONFIG_FILE:-}" ] && [ ! -f "$CONFIG_FILE" ]; then
  echo "error: CONFIG_FILE=$CONFIG_FILE: no such file (relative to $PWD): set CONFIG_FILE to a TOML config, e.g." \
    "train_configs/debug_model.toml" >&2
  exit 2
fi
cd "$(dirname "$0")"
PYTHON=${PYTHON:-$(command -v python || command -v python3)} || {
  echo "error: neither python nor python3 is on PATH: set PYTHON to the interpreter that has torch" >&2; exit 127; }
if [ -z "${NGPU:-}" ]; then
  if ls /dev/nvidia[0-9]* /dev/kfd >/dev/null 2>&1; then  # a GPU driver: let torch count (honours CUDA_VISIBLE_DEVICES)
    NGPU=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 4)")
  else  # none: skip importing torch just to learn that (~1.5 s of start-up)
    NGPU=4
  fi
fi
CONFIG_FILE=${CONFIG_FILE:-$PWD/train_configs/debug_model.toml}
for arg in "$@"; do  # the options' help, once, from one process: no check, no worker
  case $arg in -h|--help) exec "$PYTHON" train.py --help ;; esac
done
LOG_RANK=${LOG_RANK:-0}
lighthouse=${TORCHFT_LIGHTHOUSE:-}
if [ -n "${REPLICA_GROUPS:-}" ]; then  # after the user's arguments: the groups are this script's to number
  if ! [[ $REPLICA_GROUPS =~ ^[1-9][0-9]*$ ]]; then
    echo "error: REPLICA_GROUPS=$REPLICA_GROUPS: set it to the number of replica groups (1 or more), or unset it" >&2
    exit 2
  fi
  set -- "$@" --fault_tolerance.enable --fault_tolerance.group_size "$REPLICA_GROUPS" \
    --fault_tolerance.groups_per_machine "$REPLICA_GROUPS"
  MAX_RESTARTS=${MAX_RESTARTS:-3}  # restarting a group that fails is what the mode is for
  lighthouse=${lighthouse:-started by the launcher}  # for the check, which only asks whether there is one
fi
MAX_RESTARTS=${MAX_RESTARTS:-0}
export PYTHONUNBUFFERED=1
# What torchrun sets when unset, with a five-line banner saying so; the trainer sets its own thread count anyway.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# One node: the workers keep torchrun's shared store (torch >= 2.5), which its agent serves before they start. Unshared
# (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which the Slurm script sets for nodes that join later), rank 0 would serve one
# on the port the agent found free seconds before, which another job on this machine can take meanwhile (EADDRINUSE).
# Restarted workers do not read the dead ones' addresses: each round's process group gets a fresh store
# (torchtitan_lite/runtime/process.py).
# Ctrl-C reaches this script and what runs in its process group (the terminal's foreground group), not the workers
# (torchrun gives each a session of its own). Until the workers run their loop, it stops the job before its first
# step, in one line, whenever it comes. The commands below run in the background, where SIGINT is ignored: the check
# and the lock's holder run to their end, then this script stops; torchrun and its workers inherit that, and the trap
# first creates the file TORCHTITAN_LITE_INTERRUPTED names, which each worker looks for once it listens, then passes
# the signal on (torchtitan_lite/runtime/startup_interrupt.py). torchrun is left alone: it would raise a
# SignalException, pass the signal on, SIGKILL workers still saving 30 s later and exit 1 with a traceback. In the
# loop Ctrl-C is the workers' preemption (below), and a second Ctrl-C kills the job at once: the checkpoint being
# written is never published (torchtitan_lite/checkpoint/manager.py writes step-N.tmp and renames it when complete).
plan=${TMPDIR:-/tmp}/run_train.$$.plan errors=${TMPDIR:-/tmp}/run_train.$$.errors
export TORCHTITAN_LITE_INTERRUPTED=${TMPDIR:-/tmp}/run_train.$$.interrupted
trap 'rm -f "$plan" "$errors" "$TORCHTITAN_LITE_INTERRUPTED" 2>/dev/null || :' EXIT  # set -e holds in traps too
launcher= interrupts=0  # torchrun, once it runs; how many times Ctrl-C came
interrupt() {
  interrupts=$((interrupts + 1))
  if [ "$interrupts" = 1 ]; then
    : >"$TORCHTITAN_LITE_INTERRUPTED"
    [ -z "$launcher" ] || pkill -INT -P "$launcher" || true
  elif [ -n "$launcher" ]; then  # torchrun with them, in one call: alone it would report dead workers and restart them
    kill -KILL "$launcher" $(pgrep -P "$launcher") 2>/dev/null || true
  fi
}
trap interrupt INT
finished() {  # the exit status of background process $1 once it has ended: a trap that runs cuts `wait` short
  while kill -0 "$1" 2>/dev/null; do wait "$1" || :; done
  wait "$1"  # bash keeps the status of a background process it reaped
}
# A command forked in the very moment a Ctrl-C comes is killed by it before it can ignore it: its status is 130, or
# -1 (255) where bash's wait, cut short by the trap, lost it.
killed_at_fork() { [ "$interrupts" -gt 0 ] && { [ "$1" = 130 ] || [ "$1" = 255 ]; }; }
stopped="Ctrl-C during start-up: stopped before the first step, nothing saved"  # as rank 0 says it (train.py)
ran() {  # for a command before torchrun: its exit status, or the job ends if a Ctrl-C came meanwhile
  local status=0
  finished "$1" || status=$?
  if [ "$status" = 0 ] && [ "$interrupts" -gt 0 ] || killed_at_fork "$status"; then echo "$stopped" >&2; exit 130; fi
  return "$status"
}
# A config every rank would reject alike (a typo, degrees that do not fit NGPU, a missing file, a folder a live run
# holds) is reported in one line by one process before torchrun starts, rather than by rank 0 and then torchrun's
# failure summary. A good one prints the run's plan, and what this script needs of it goes in $plan.
: >"$errors"
TORCHTITAN_LITE_PLAN_FILE=$plan WORLD_SIZE=$NGPU TORCHFT_LIGHTHOUSE=$lighthouse "$PYTHON" train.py --check \
  --job.config_file "$CONFIG_FILE" "$@" &
ran $! || exit $?
for arg in "$@"; do [ "$arg" != --check ] || exit 0; done  # ./run_train.sh ... --check: the check alone
checkpoints=$(sed -n 's/^checkpoint_folder=//p' "$plan")
grep -qx 'nothing_to_do=1' "$plan" && exit 0  # the check said why
# The folder's lock, held by this script for the whole job (its rank 0 is told so): another run_train.sh that passed
# its check at the same moment is refused here, before it starts a worker (torchtitan_lite/runtime/run_lock.py).
dump=$(sed -n 's/^dump_folder=//p' "$plan")
mkdir -p "$dump" && exec 9<>"$dump/run.lock"
"$PYTHON" -m torchtitan_lite.runtime.run_lock 9 "$dump" "$(sed -n 's/^shared_lock=//p' "$plan")" &
ran $! || exit $?
export TORCHTITAN_LITE_LAUNCHER_HOLDS=$dump
export TORCHTITAN_LITE_PLAN_SHOWN=1  # rank 0 does not print the plan again
if [ -n "${REPLICA_GROUPS:-}" ]; then  # a torchrun per group, restarted when it fails; it handles the signals itself
  rm -f "$plan" "$errors"
  exec "$PYTHON" -m torchtitan_lite.runtime.replica_launcher "$REPLICA_GROUPS" "$NGPU" "$MAX_RESTARTS" "$LOG_RANK" \
    --job.config_file "$CONFIG_FILE" "$@"
fi
echo "starting $NGPU process$([ "$NGPU" = 1 ] || echo es) (torchrun)"
# Preemption (SIGTERM from Slurm or Kubernetes, SIGUSR1 as Slurm's early warning) goes to the workers, torchrun's
# children: they agree on a step, save it and exit 0, and torchrun with them. Given to torchrun itself, the signal
# would also reach them, but torchrun would report it as a failure (exit 1). Ctrl-C is the same preemption, and the
# job exits 130 (the shell's convention for it; the workers exit 0, as torchrun takes anything else for a failure to
# report and restart).
# The traps come first: a signal in the moment before them would end this script and leave torchrun running alone.
trap 'pkill -TERM -P "$launcher" || true' TERM
trap 'pkill -USR1 -P "$launcher" || true' USR1
kept() {  # what a job killed now leaves: a save in progress is never published (step-N.tmp)
  if [ -z "$checkpoints" ]; then echo "checkpoint.enable is off: nothing was saved"; return; fi
  newest=$(ls -d "$checkpoints"/step-*/.metadata 2>/dev/null | sed 's|/.metadata$||; s|.*/step-||' | sort -n | tail -1)
  if [ -n "$newest" ]; then echo "the newest complete checkpoint is $checkpoints/step-$newest"
  else echo "no checkpoint was complete yet in $checkpoints"; fi
}
TORCHTITAN_LITE_ERROR_LOG=$errors "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
  --max-restarts="$MAX_RESTARTS" --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  --signals-to-handle SIGTERM,SIGHUP,SIGQUIT \
  train.py --job.config_file "$CONFIG_FILE" "$@" &
launcher=$!
status=0
finished "$launcher" || status=$?
# After bash's own notice of the job it killed, which it prints as it reaps it.
if [ "$interrupts" -gt 1 ]; then echo "second Ctrl-C: stopped at once; $(kept)" >&2; fi
if [ "$interrupts" = 1 ] && killed_at_fork "$status"; then echo "$stopped" >&2; status=130; fi  # torchrun never does
if [ "$interrupts" -gt 1 ] || { [ "$interrupts" = 1 ] && [ "$status" = 0 ]; }; then status=130; fi
# torchrun's failure summary names the first rank to exit, which is not always the one that explains the failure
# (a hung peer's survivors exit first): the job's own error line, said above, comes last again.
if [ "$status" != 0 ] && [ -s "$errors" ]; then tail -n 1 "$errors" >&2; fi
exit "$status"
