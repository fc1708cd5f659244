"""torchft's lighthouse for REPLICA_GROUPS' launcher: one on a port of this machine, started again there if it dies.

    python torchtitan_lite/runtime/lighthouse.py [torchft_lighthouse's options]

The lighthouse is the one process every replica group asks, at each step, who is alive: without it no group can start
a step, so it must not end the run when it dies. It keeps no state a run needs: a new one on the same address learns
the groups from their heartbeats and requests, and forms the next quorum as the old one would have. What the groups
do about it (torchft 0.2.0, found by killing one mid-run, tests/multiprocess/test_replica_groups.py): each group's
Manager reconnects on its own, its heartbeat within a fraction of a second and its quorum request on a retry every
5 s, which training/replicas.py asks for (with none, torchft's default, a request the dead lighthouse failed is never
answered: the group waits out quorum_timeout_ms and fails, a new lighthouse or not); the new lighthouse numbers its
quorums from 1 again, which training/replica_quorum.py keeps from confusing torchft. A group whose request reaches
the new lighthouse before the others' heartbeats do is a quorum of its own for a step, and the others heal from it,
as after any absence.

So the new one should be up long before the groups' next retry: this module runs the program's Rust main alone,
where `torchft_lighthouse` imports torchft, and with it torch, first (seconds: docs/fault_tolerance.md). It is run
as a file, not with -m: the Rust main parses the process's arguments after the first, which -m would make its own.
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from collections.abc import Callable

HEARTBEAT_MS = "LIGHTHOUSE_HEARTBEAT_MS"  # how long a silent group stays in the quorum (torchft's default: 5 s)
# How long a quorum waits for a live group (its heartbeat comes) to end its step: as long as the groups' own
# fault_tolerance.quorum_timeout_ms, which it must not be shorter than. Shorter, the others would form a quorum
# without a group in a long step (a checkpoint save), which then trains on in a quorum of its own for a step.
JOIN_TIMEOUT_MS = "LIGHTHOUSE_JOIN_TIMEOUT_MS"


class Lighthouse:
    """The lighthouse's process on `port`, started again on it when it dies, up to `restarts` times."""

    def __init__(self, restarts: int, start_child: Callable[[], None]):
        self.restarts, self.started, self._start_child = restarts, 0, start_child
        with socket.socket() as s:  # a port free now: the lighthouse binds it a moment later, and again after a death
            s.bind(("", 0))
            self.port = s.getsockname()[1]
        self.address = f"http://{socket.gethostname()}:{self.port}"
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        """Every group may train alone (min_replicas 1): the groups' own fault_tolerance.min_replica_size decides."""
        self.started += 1
        return subprocess.Popen([sys.executable, __file__, "--min_replicas", "1", "--bind", f"[::]:{self.port}",
                                 "--join_timeout_ms", os.environ.get(JOIN_TIMEOUT_MS, "600000"),
                                 "--heartbeat_timeout_ms", os.environ.get(HEARTBEAT_MS, "5000")],
                                env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "error")},
                                start_new_session=True, preexec_fn=self._start_child)

    def tend(self) -> bool:
        """Starts the lighthouse again if it has died; False once it has died more than `restarts` times."""
        if (status := self.proc.poll()) is None:
            return True
        if self.started > self.restarts:
            print(f"error: the lighthouse died (exit {status}) and was started again {self.restarts} times already: "
                  "the groups cannot go on without it, and are stopped; rerun the command to resume from the newest "
                  "checkpoint (raise MAX_RESTARTS if it dies this often)", file=sys.stderr, flush=True)
            return False
        print(f"the lighthouse died (exit {status}): starting it again on port {self.port} ({self.started} of "
              f"{self.restarts} restarts)", file=sys.stderr, flush=True)
        self.proc = self._start()
        return True

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _rust_main() -> Callable[[], None]:
    """torchft's lighthouse program, without importing the torchft package (and torch) around it: its extension
    module loaded from its file; the program itself where the file is not found (another torchft's layout)."""
    found = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "torchft", "_torchft*.so"))
    if not found:
        program = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable),
                                                                      "torchft_lighthouse")
        return lambda: os.execv(program, [program, *sys.argv[1:]])
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", found[0])
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("torchft._torchft", found[0],
                                                                                    loader=loader))
    loader.exec_module(module)
    return module.lighthouse_main


if __name__ == "__main__":
    _rust_main()()
