"""train.py that a test can hold at the start of a step, to act on the job (kill a rank, a node, add one) at a known
point of its curve.

    gate.py FOLDER [DIE_RANK DIE_STEP] TRAIN_ARGS...

Before each step s every rank waits while FOLDER/hold-s exists; a preemption signal (torchrun stopping the workers to
resize the job) releases it, so the step runs and is saved as on any preemption. On the launch's first attempt, rank
DIE_RANK SIGKILLs itself at the start of step DIE_STEP, as a worker that crashes or is OOM-killed.

A replica group (fault_tolerance.enable) also waits, before asking who is alive for step s, while FOLDER/hold-q<s>
exists, so the others stay out of the quorum until a test lets them in; and says it asks, by creating
FOLDER/joining-<replica id>-<torchrun's restart count>.
"""

import os
import signal
import sys
import time
from pathlib import Path

import train
from torchtitan_lite.runtime import signals

folder, argv = Path(sys.argv[1]), sys.argv[2:]
die_rank = die_step = None
if argv and not argv[0].startswith("--"):
    die_rank, die_step, argv = int(argv[0]), int(argv[1]), argv[2:]
next_batch = train.DataLoader.next_batch


def gated_next_batch(self):
    step = self.position // self.global_batch + 1  # the step this batch is for, resumed or not
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and step == die_step and int(os.environ["RANK"]) == die_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    while (folder / f"hold-{step}").exists() and not any(p.received for p in signals._installed):
        time.sleep(0.05)
    return next_batch(self)


def gated_quorum(self):
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    (folder / f"joining-{self.cfg.replica_id}-{restarts}").touch()
    while (folder / f"hold-q{self.train_state.step + 1}").exists():
        time.sleep(0.05)
    return quorum(self)


train.DataLoader.next_batch = gated_next_batch
quorum, train.Replicas._quorum = train.Replicas._quorum, gated_quorum
sys.exit(train.run(argv))
