"""The run's steps, and what happens between two of them.

Iterating `Steps` gives the loop each step to train, from the one after the checkpoint's to training.steps, and does
around each what belongs to no phase of it:
- before: a scheduled garbage collection, and the start of the agreement on signals (signals.py);
- after: the agreement's answer, the profiler's step (profiling.py) and a memory snapshot's (memory_snapshot.py);
  when a rank was signalled, a checkpoint of this step and the end of the iteration.

Garbage collection runs on a schedule, `training.gc_freq`, with automatic collection off: Python's own collections
come at a moment of each process's allocations, so a rank paused in one holds the others up at the next collective,
at a different step on each rank. Collected at the same steps, all ranks pause together.

The agreement runs in the background through the step (signals.py): every rank reads the same answer at its end, so
all stop after the same step, saved, and the loop stops without asking why. `stopped` then names the signal.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator

from torchtitan_lite.checkpoint.manager import CheckpointManager
from torchtitan_lite.runtime.memory_snapshot import MemorySnapshots
from torchtitan_lite.runtime.phases import Phases
from torchtitan_lite.runtime.profiling import StepProfiler
from torchtitan_lite.runtime.signals import Preemption

logger = logging.getLogger("torchtitan_lite")


class Steps:
    def __init__(self, start: int, last: int, gc_freq: int, preemption: Preemption, profiler: StepProfiler,
                 snapshots: MemorySnapshots, phase: Phases, checkpoint: CheckpointManager):
        """Steps start + 1 to last: `start` is the step the run resumes after (0 for a fresh run)."""
        self.first, self.last, self.done, self.gc_freq = start + 1, last, start, gc_freq
        self.preemption, self.profiler, self.snapshots, self.phase = preemption, profiler, snapshots, phase
        self.checkpoint = checkpoint
        self.stopped: str | None = None  # the signal that ended the run early
        self._start = time.perf_counter()

    def seconds(self) -> float:
        """Since the steps were set up: this run's training time."""
        return time.perf_counter() - self._start

    def __iter__(self) -> Iterator[int]:
        if self.gc_freq > 0:
            gc.disable()
        for step in range(self.first, self.last + 1):
            if self.gc_freq > 0 and step % self.gc_freq == 0:
                gc.collect(1)
            self.preemption.begin_step(step)
            yield step
            self.done = step
            with self.phase("signals"):
                received = self.preemption.requested()
            self.profiler.step()
            self.snapshots.step(step)
            if received and step < self.last:
                self._stop(step, received)
                return

    def _stop(self, step: int, received: str) -> None:
        saving = self.checkpoint.cfg.enable
        if saving and step % self.checkpoint.cfg.interval:
            self.checkpoint.save(step)  # the full state, whatever the last save would be: the run goes on elsewhere
        logger.warning("%s: stopped after step %d%s", received, step, ", checkpoint saved: rerun the same command "
                       "to resume" if saving else " (checkpoint.enable is off: nothing saved)")
        self.stopped = received
