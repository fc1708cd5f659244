"""Ctrl-C during start-up: the job stops before its first step, in one line, whenever the signal came.

The launchers pass Ctrl-C on to the workers themselves (run_train.sh, and replica_launcher.py to every group's):
torchrun must not take it, so it runs with SIGINT ignored, and its workers inherit that. A worker heeds SIGINT only
once train.run starts, seconds after it was started (importing torch takes most of them): a Ctrl-C passed on before
was lost, and one that came while torchrun itself still started found no worker to pass it to. The job then trained
to its end, and only then exited 130. So a launcher first creates the file TORCHTITAN_LITE_INTERRUPTED names, then
sends the signal, and a worker first heeds SIGINT, then looks for the file: a signal it could not hear left the file
before it looks, and one that comes later raises KeyboardInterrupt, on which start-up stops (train.run says the
line). From the loop's preemption on, Ctrl-C stops the run after a step instead (signals.py).

No torch here: the replica launcher imports this module, and it starts in a moment.
"""

from __future__ import annotations

import os
import signal

INTERRUPTED = "TORCHTITAN_LITE_INTERRUPTED"  # the file a launcher creates on the first Ctrl-C


def heed() -> None:
    """From now on Ctrl-C raises KeyboardInterrupt; at once when the launcher passed one on before this call."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if (mark := os.environ.get(INTERRUPTED)) and os.path.exists(mark):
        raise KeyboardInterrupt


def mark(path: str) -> None:
    """The launcher's side, before it passes the signal on: a worker not yet listening finds `path` instead."""
    with open(path, "a"):
        pass
