"""train.py that a test can hold at the start of a step, to act on the job (kill a rank, a node, add one) at a known
point of its curve.

    gate.py FOLDER [DIE_RANK DIE_STEP] TRAIN_ARGS...

Before each step s every rank waits while FOLDER/hold-s exists; a preemption signal (torchrun stopping the workers to
resize the job) releases it, so the step runs and is saved as on any preemption. On the launch's first attempt, rank
DIE_RANK SIGKILLs itself at the start of step DIE_STEP, as a worker that crashes or is OOM-killed.

A replica group (fault_tolerance.enable) also waits, before asking who is alive for step s, while FOLDER/hold-q<s>
(or FOLDER/hold-q<s>-<replica id>, for that group alone) exists, so the others stay out of the quorum until a test
lets them in; says it asks, by creating FOLDER/joining-<replica id>-<times restarted>; and says its rank 0 waits at
step s's hold (its step s begun), by creating FOLDER/waiting-<replica id>-<s>. Markers a test creates act once, in
the first process to find them: FOLDER/freeze-after-commit-<replica id>-<s> SIGSTOPs that group's rank 0 once it has
committed step s (before it logs or saves it; FOLDER/frozen-<replica id> says so),
FOLDER/kill-after-commit-<replica id>-<s> SIGKILLs it there, and FOLDER/hang-<replica id>-<s> holds the group in its
all-reduce of step s for ever, alive (FOLDER/hanging-<replica id>). A save of step s waits before its `.metadata`
while FOLDER/hold-save-<s> exists (FOLDER/saving-<s> says it does). Only the group DIE_REPLICA dies, at the start of
the step or, with DIE_IN "reduce", in its all-reduce across the groups (after its backward, the others waiting in
theirs). A group asked to send its state to a group that heals SIGKILLs itself instead while FOLDER/die-serving
exists (the first to be asked takes the file away).

A job that run_train.sh starts (REPLICA_GROUPS: a torchrun per group) gets the gate from the environment instead,
SUITE_GATE=FOLDER[:DIE_REPLICA:DIE_RANK:DIE_STEP[:DIE_IN]], which tests/quick_exit/sitecustomize.py reads in every
worker.
"""

import os
import signal
import sys
import time
from pathlib import Path

from torchtitan_lite.checkpoint import manager
from torchtitan_lite.data.loader import DataLoader
from torchtitan_lite.runtime import signals
from torchtitan_lite.training import replicas
from torchtitan_lite.training.replicas import Replicas


def _replica_id() -> str | None:
    argv = sys.argv
    ids = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--fault_tolerance.replica_id"]
    return ids[-1] if ids else None


def install(folder: Path, die_rank: int | None = None, die_step: int | None = None,
            die_replica: str | None = None, die_in: str = "data") -> None:
    next_batch, quorum, serve, reduce = DataLoader.next_batch, Replicas._quorum, Replicas._serve, Replicas.reduce
    commit, finish = Replicas.commit, manager._Writer.finish

    def taken(marker: str) -> bool:
        """Whether `marker` was there, which this process then takes away (one process acts on it, once)."""
        try:
            (folder / marker).unlink()
            return True
        except FileNotFoundError:
            return False

    def die_at(step: int, phase: str) -> None:
        if (replicas.restarts() == 0 and step == die_step and phase == die_in and int(os.environ["RANK"]) == die_rank
                and die_replica in (None, _replica_id())):
            os.kill(os.getpid(), signal.SIGKILL)

    def gated_next_batch(self):
        step = self.position // self.global_batch + 1  # the step this batch is for, resumed or not
        replica = _replica_id()
        die_at(step, "data")
        if replica is not None and os.environ["RANK"] == "0" and (folder / f"hold-{step}").exists():
            (folder / f"waiting-{replica}-{step}").touch()
        while (folder / f"hold-{step}").exists() and not any(p.received for p in signals._installed):
            time.sleep(0.05)
        return next_batch(self)

    def gated_quorum(self):
        (folder / f"joining-{self.cfg.replica_id}-{replicas.restarts()}").touch()
        hold = f"hold-q{self.train_state.step + 1}"
        while (folder / hold).exists() or (folder / f"{hold}-{self.cfg.replica_id}").exists():
            time.sleep(0.05)
        return quorum(self)

    def gated_serve(self):
        try:
            (folder / "die-serving").unlink()
        except FileNotFoundError:
            return serve(self)
        (folder / f"died-serving-{self.cfg.replica_id}").touch()
        os.kill(os.getpid(), signal.SIGKILL)

    def gated_reduce(self, losses):
        die_at(self.train_state.step + 1, "reduce")
        return reduce(self, losses)

    def gated_commit(self):
        committed = commit(self)
        step = self.train_state.step + 1
        if committed and self.group_rank == 0 and taken(f"freeze-after-commit-{self.cfg.replica_id}-{step}"):
            (folder / f"frozen-{self.cfg.replica_id}").touch()
            os.kill(os.getpid(), signal.SIGSTOP)
        if committed and self.group_rank == 0 and taken(f"kill-after-commit-{self.cfg.replica_id}-{step}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return committed

    def gated_finish(self, metadata, results):
        step = int(Path(self.path).name.split(".")[0].split("-")[1])
        if (folder / f"hold-save-{step}").exists():
            (folder / f"saving-{step}").touch()
        while (folder / f"hold-save-{step}").exists():
            time.sleep(0.05)
        return finish(self, metadata, results)

    def hanging_reduce(self, losses):
        if taken(f"hang-{self.cfg.replica_id}-{self.train_state.step + 1}"):
            (folder / f"hanging-{self.cfg.replica_id}").touch()
            while True:  # alive, its heartbeat beating: stuck in its step
                time.sleep(1)
        return gated_reduce(self, losses)

    DataLoader.next_batch = gated_next_batch
    Replicas._quorum, Replicas._serve, Replicas.reduce = gated_quorum, gated_serve, hanging_reduce
    Replicas.commit, manager._Writer.finish = gated_commit, gated_finish


def install_from_env() -> None:
    folder, *die = os.environ["SUITE_GATE"].split(":")
    install(Path(folder), *((int(die[1]), int(die[2]), die[0], *die[3:]) if die else ()))


if __name__ == "__main__":
    import train

    path, argv = Path(sys.argv[1]), sys.argv[2:]
    if argv and not argv[0].startswith("--"):
        install(path, int(argv[0]), int(argv[1]))
        argv = argv[2:]
    else:
        install(path)
    sys.exit(train.run(argv))
