"""A bound on a stretch of the training thread: past it, the process ends with one line.

A replica group that hangs while alive (a deadlock, stuck I/O, a thread asleep in its step) keeps its place in the
run: torchft's heartbeat is a thread of its own, which beats on while the training thread is stuck, so the lighthouse
never drops the group and the others wait for it at every quorum, until their own timeout. A group that makes no
progress through its step for a bounded time therefore leaves: its process exits, its heartbeat stops with it, the
others go on without it, and its launcher starts it again, when it heals from them and rejoins (training/replicas.py).
The watchdog is a thread of its own, so it runs while the training thread waits in a collective or a sleep (any wait
that lets go of the GIL, as gloo's and the filesystem's do).
"""

from __future__ import annotations

import logging
import os
import threading
import time

logger = logging.getLogger("torchtitan_lite")


class Watchdog:
    """Ends this process if a stretch `arm` begins is not `disarm`ed within its bound."""

    def __init__(self, name: str):
        self.name = name  # who leaves, for the line: "replica group 1"
        self._deadline: tuple[float, float, str] | None = None  # (when, bound in s, what it bounds)
        self._wake = threading.Condition()
        threading.Thread(target=self._watch, name="progress-watchdog", daemon=True).start()

    def arm(self, seconds: float, what: str) -> None:
        """Begins a stretch that must end within `seconds`: `what` names it (the key that sets the bound too)."""
        with self._wake:
            self._deadline = (time.monotonic() + seconds, seconds, what)
            self._wake.notify()

    def disarm(self) -> None:
        with self._wake:
            self._deadline = None

    def _watch(self) -> None:
        with self._wake:
            while True:
                if self._deadline is None:
                    self._wake.wait()
                    continue
                when, seconds, what = self._deadline
                if time.monotonic() < when:
                    self._wake.wait(when - time.monotonic())
                    continue
                logger.error("error: %s made no progress in %s for %g s: it leaves the run, so that the others go "
                             "on without it, and heals from them when started again", self.name, what, seconds)
                for handler in logging.getLogger().handlers + logger.handlers:
                    handler.flush()
                os._exit(1)
