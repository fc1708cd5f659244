"""Signals and a vanished launcher.

Preemption: SIGTERM (what Slurm and Kubernetes send before they kill a job), SIGUSR1 (Slurm's early warning,
`sbatch --signal=USR1@120`) and SIGINT (Ctrl-C) end the run at a step boundary, with a checkpoint of that step.

A handler runs between two bytecodes of whatever the rank was doing, a collective included, so it only records the
signal. Ranks receive it at different moments (torchrun forwards it to each worker in turn), so they must agree on
the step after which they stop: each step starts a one-element MAX all-reduce of "signalled yet?" in the background,
on the CPU (gloo), and reads it when the step is done. The all-reduce overlaps the step's compute instead of adding
to it, and every rank reads the same value, so all stop after the same step and none waits in a collective for a
rank that left. A second SIGTERM or SIGUSR1 only records itself again: the save in progress is not interrupted (and
were the job killed outright, the save is atomic: checkpoint/manager.py). A second Ctrl-C is someone who will not
wait: it kills the process at once (run_train.sh kills the whole job instead), which the atomic save makes safe.

The stop comes at a step boundary, which on a slow machine may be minutes away, so the signal is acknowledged at
once, in one line saying after which step the run stops and whether it saves. Python runs a signal's handler only
between two bytecodes of the main thread, which may be inside one long matmul or collective; so the C-level handler
also writes the signal's number to a pipe (signal.set_wakeup_fd), and a thread waiting on that pipe says the line
while the main thread computes on.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

logger = logging.getLogger("torchtitan_lite")
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_installed: list[Preemption] = []


class Preemption:
    def __init__(self, group: dist.ProcessGroup | None, saving: bool = False, speak: bool = False):
        """`saving`: whether the stop saves a checkpoint; `speak`: whether this rank acknowledges signals (rank 0)."""
        self.received: int | None = None
        self.step, self.saving, self._acknowledged = 0, saving, False  # the step in progress, for the acknowledgement
        self._group, self._flag, self._work = group, torch.zeros(1, dtype=torch.int32), None
        self._previous = {s: signal.signal(s, self._record) for s in SIGNALS}
        self._wakeup = _listen(self._acknowledge) if speak else None
        _installed.append(self)

    def _acknowledge(self, signum: int) -> None:
        """Says at once what the first signal does (from the listening thread: see the module's docstring)."""
        if self._acknowledged or signum not in SIGNALS:
            return  # a later signal: the first one's line stands
        self._acknowledged = True
        name = signal.Signals(signum).name
        # Sent now, it misses the agreement of the step in progress, which began before it: the next step's
        # catches it (unless another rank received a signal earlier, and then the stop comes sooner).
        then = ("saving a checkpoint" if self.saving else "without saving (checkpoint.enable is off)")
        again = "; Ctrl-C again stops at once, without saving" if signum == signal.SIGINT else ""
        logger.warning("%s: stopping after step %d at the latest, %s%s", name, self.step + 1, then, again)

    def _record(self, signum: int, frame) -> None:
        self.received = signum
        if signum == signal.SIGINT:  # the default action, not KeyboardInterrupt: it ends even a rank stuck in C++
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    def begin_step(self, step: int) -> None:
        self.step = step
        self._flag.fill_(self.received is not None)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """Where this job's ranks agree on a host value (gloo beside a GPU's NCCL; None: the default group)."""
        return self._group

    def vote(self) -> int:
        """This job's agreement for the step in progress (1: some rank was signalled before it began), for one
        across jobs (replica groups: replicas.py), which widen() then makes the answer."""
        self._work.wait()
        return int(self._flag.item())

    def widen(self, signalled: bool) -> None:
        self._flag.fill_(signalled)

    def requested(self) -> str | None:
        """After a step: the name of the signal some rank received before the step began, or None; the same answer
        on every rank."""
        self._work.wait()
        if not self._flag.item():
            return None
        return signal.Signals(self.received).name if self.received is not None else "a signal to another rank"

    def close(self) -> None:
        """Gives the signals back to their previous handlers."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._wakeup is not None:
            previous, write_end, listener = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write_end)  # the listening thread reads the end of its pipe and ends
            # Joined: a daemon thread still leaving while the interpreter finalizes can abort the process at exit
            # ("terminate called without an active exception": seen on loaded machines, never once joined).
            listener.join()
            self._wakeup = None


def _listen(acknowledge) -> tuple[int, int, threading.Thread]:
    """Calls `acknowledge(signum)` from a thread of its own as each signal arrives; returns (the wakeup fd it
    replaced, its pipe's write end, the thread) for close()."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # set_wakeup_fd's requirement: the C handler must never block
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def listen() -> None:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            while data := pipe.read(64):
                for signum in data:
                    acknowledge(signum)

    listener = threading.Thread(target=listen, name="signal-acknowledgement", daemon=True)
    listener.start()
    return previous, write_end, listener


def stop_requested() -> bool:
    """Whether this process has received a preemption signal (torchrun sends SIGTERM to every worker of a group it
    stops, as when one of them died)."""
    return any(p.received is not None for p in _installed)


def restore_signals() -> None:
    """Undoes every Preemption still installed: a caller of train.run in this process keeps its own handlers."""
    while _installed:
        _installed.pop().close()


def exit_code(stopped: str | None) -> int:
    """A run's exit status once it ended cleanly, `stopped` early by the named signal or not: 130 after Ctrl-C, the
    shell's convention, so that `python train.py && next` stops there. Under torchrun 0 all the same: torchrun takes
    any other status for a failed worker, reports it and restarts it; run_train.sh exits 130 for the whole job."""
    return 130 if stopped == "SIGINT" and "TORCHELASTIC_RUN_ID" not in os.environ else 0


def stop_with_launcher(poll_s: float = 1.0) -> None:
    """Under torchrun, ends this worker within `poll_s` of its launcher's death. torchrun starts each worker in a
    session of its own, so a launcher killed outright (SIGKILL, the OOM killer) takes no worker with it: they would
    train on as orphans, nobody watching them, writing checkpoints beside a restarted job. A worker's parent is its
    launcher; once the parent is another process (the orphan was re-parented), the launcher is gone."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        try:
            print(f"error: rank {os.environ.get('RANK')}: the launcher (pid {launcher}) is gone: this worker stops "
                  "rather than train unsupervised", file=sys.stderr, flush=True)
        finally:  # no cleanup: checkpoints are atomic, and a collective in progress cannot be left politely
            os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
