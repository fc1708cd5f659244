"""run_train.sh's REPLICA_GROUPS mode: one run as R replica groups on this machine, each its own torchrun job.

    python -m torchtitan_lite.runtime.replica_launcher GROUPS NPROC RESTARTS LOG_RANKS TRAIN_ARGS...

It starts torchft's lighthouse (unless the arguments or TORCHFT_LIGHTHOUSE name one), then one torchrun per group,
each worker told its group (`--fault_tolerance.replica_id N`), and watches them. A group whose torchrun ends in a
failure (a worker killed, or torchrun itself) is started again, up to RESTARTS times, while the others train on: it
heals from them and rejoins (training/replicas.py). So is the lighthouse, on its port, which the groups reconnect to
(lighthouse.py). A failed group is one line of this launcher's, not torchrun's report (torchrun_output.py). The
command ends once every group has: 0 when the run completed (some group trained it to its end or stopped it on a
signal), else 1.

A group is restarted whole, by a new torchrun, rather than by torchrun's own restarts: a killed torchrun has nobody
to restart it. Each torchrun is in a session of its own, so Ctrl-C at the terminal reaches this process alone, which
passes it (and SIGTERM, SIGUSR1) to every group's workers, as run_train.sh does for one job; and each torchrun dies
with this process (PR_SET_PDEATHSIG), its workers a moment later (signals.stop_with_launcher): a launcher killed
outright leaves no group training unsupervised.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from torchtitan_lite.runtime import startup_interrupt
from torchtitan_lite.runtime.lighthouse import Lighthouse
from torchtitan_lite.runtime.torchrun_output import relay

RESTARTED = "TORCHTITAN_LITE_GROUP_RESTARTS"  # how many times the launcher has started this group again
_POLL_S = 0.1


def _die_with_parent() -> None:
    """In a child before it runs: SIGKILLed when this launcher dies (Linux), and deaf to SIGINT, which this launcher
    passes on itself: torchrun's workers inherit that until they listen (startup_interrupt.py)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _children(pid: int) -> list[int]:
    pids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            pids += [int(c) for c in (task / "children").read_text().split()]
    return pids


class Groups:
    """The groups' torchruns: started, signalled, watched and started again."""

    def __init__(self, groups: int, nproc: int, restarts: int, log_ranks: str, args: list[str]):
        self.groups, self.nproc, self.restarts, self.log_ranks, self.args = groups, nproc, restarts, log_ranks, args
        self.procs: dict[int, subprocess.Popen] = {}
        self.relays: dict[int, threading.Thread] = {}  # group -> the thread passing its torchrun's stderr on
        self.started = [0] * groups  # starts of each group
        self.ended: dict[int, int] = {}  # group -> its torchrun's final status
        self.interrupts, self.stopping = 0, False

    def start(self, group: int) -> None:
        """Group `group`'s torchrun, its workers told which group they are."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}",
               "--max-restarts=0", "--local-ranks-filter", self.log_ranks, "--role", f"group{group}-rank",
               "--tee", "3", "--signals-to-handle", "SIGTERM,SIGHUP,SIGQUIT", "train.py", *self.args,
               "--fault_tolerance.replica_id", str(group)]
        env = {**os.environ, RESTARTED: str(self.started[group])}
        self.procs[group] = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, start_new_session=True,
                                             preexec_fn=_die_with_parent)
        # The workers' lines come through torchrun's stderr (--tee), each named by its prefix: passed on as they come
        self.relays[group] = threading.Thread(target=relay, args=(self.procs[group].stderr, sys.stderr.buffer),
                                              daemon=True)
        self.relays[group].start()
        self.started[group] += 1

    def signal_workers(self, signum: int) -> None:
        """To every worker; to a torchrun whose workers have not started yet (a group starting again), itself."""
        for proc in self.procs.values():
            for pid in _children(proc.pid) or [proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

    def kill(self) -> None:
        """Every group at once, torchrun and workers."""
        for proc in self.procs.values():
            for pid in [proc.pid, *_children(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def on_signal(self, signum: int, frame) -> None:
        self.stopping = True  # nothing is started again: the run is being stopped
        if signum != signal.SIGINT:
            self.signal_workers(signum)
            return
        self.interrupts += 1
        if self.interrupts == 1:  # as a preemption: every group stops after the same step, saving it
            startup_interrupt.mark(os.environ[startup_interrupt.INTERRUPTED])  # or before its first: not started yet
            self.signal_workers(signal.SIGINT)
        else:
            self.kill()

    def watch(self, lighthouse: Callable[[], bool]) -> int:
        """Waits for every group to end, starting again those that fail; the command's exit status. `lighthouse`
        starts the lighthouse again if it died (lighthouse.Lighthouse.tend): False, and the groups are stopped."""
        while self.procs:
            time.sleep(_POLL_S)
            if not lighthouse():
                self.kill()
                return 1
            for group, proc in list(self.procs.items()):
                if (status := proc.poll()) is None:
                    continue
                del self.procs[group]
                self.relays[group].join(timeout=5)  # its last lines before this launcher's about it
                self._ended(group, status)
        if self.interrupts:
            return 130
        return 0 if 0 in self.ended.values() else 1  # torchrun's own status for a failed job

    def _ended(self, group: int, status: int) -> None:
        completed = 0 in self.ended.values()
        self.ended[group] = status
        if status == 0:
            return
        # Once the run has completed (or is being stopped), a group that fails has nothing left to rejoin.
        again = self.started[group] <= self.restarts and not (self.stopping or completed)
        print(f"replica group {group} failed (exit {status})" + (
            f": starting it again ({self.started[group]} of {self.restarts} restarts)" if again else
            ", not started again" + (" (out of restarts: MAX_RESTARTS)" if self.started[group] > self.restarts
                                     else "")), file=sys.stderr, flush=True)
        if again:
            self.start(group)


def lighthouse(args: list[str], restarts: int) -> Lighthouse | None:
    """torchft's lighthouse, kept alive on a port of this machine, or None when the run names one."""
    if "--fault_tolerance.lighthouse" in args or os.environ.get("TORCHFT_LIGHTHOUSE"):
        return None
    server = Lighthouse(restarts, _die_with_parent)
    os.environ["TORCHFT_LIGHTHOUSE"] = server.address
    return server


def main(argv: list[str]) -> int:
    groups, nproc, restarts, log_ranks, args = int(argv[0]), int(argv[1]), int(argv[2]), argv[3], argv[4:]
    run = Groups(groups, nproc, restarts, log_ranks, args)
    # The file a Ctrl-C creates: run_train.sh's (its exit trap, which its exec skipped, leaves it to this process).
    os.environ.setdefault(startup_interrupt.INTERRUPTED, os.path.join(tempfile.gettempdir(),
                                                                      f"replica_launcher.{os.getpid()}.interrupted"))
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(s, run.on_signal)
    server = lighthouse(args, restarts)
    print(f"starting {groups} replica groups of {nproc} process{'es' * (nproc > 1)} (torchrun each), lighthouse "
          f"{os.environ.get('TORCHFT_LIGHTHOUSE', 'of --fault_tolerance.lighthouse')}", flush=True)
    try:
        for group in range(groups):
            run.start(group)
        return run.watch(server.tend if server is not None else lambda: True)
    finally:
        run.kill()  # none is left on any way out
        if server is not None:
            server.stop()
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.environ[startup_interrupt.INTERRUPTED])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
