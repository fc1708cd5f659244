"""Tokens per second and MFU of the steps between two logging steps, measured on training alone.

A logging step's tokens/s is the tokens trained since the previous logging step over the time they took. Validation
runs between those steps but trains nothing: counted, it would lower tokens/s and MFU at every validation step and
nowhere else, a dip in the curve that is no change of speed. So validation pauses the clock (`paused`), and the window
is the training steps' time, their logging and checkpoints included (the cost of training, as a user waits for it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """The steps since the previous logging step: how many, and the seconds they took without validation."""
    seconds: float
    steps: int
    tps: float  # tokens per second per process
    mfu: float  # percent of the peak FLOP/s

    def fields(self) -> dict[str, float]:
        return {"tps": self.tps, "mfu": self.mfu}


class Throughput:
    def __init__(self, global_tokens: int, world_size: int, flops_per_token: float, peak_flops: float,
                 start_step: int, batches: Callable[[], float | None] = lambda: None):
        """`global_tokens`: the tokens of one step, all ranks together; `peak_flops`: one device's; `start_step`:
        the step the run resumes after (0 for a fresh run); `batches`, asked at each lap: the global batches this job
        trained since the last, if not one a step (replica groups: each its share of a step's). The clock starts
        now."""
        self.tokens, self.world_size, self.flops, self.peak = global_tokens, world_size, flops_per_token, peak_flops
        self.batches = batches
        self._since, self._since_step = time.perf_counter(), start_step

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside is left out of the window."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self._since += time.perf_counter() - begin

    def lap(self, step: int) -> Window:
        """At a logging step: the window since the previous one, and a new one begins."""
        now = time.perf_counter()
        seconds, steps = now - self._since, step - self._since_step
        batches = self.batches()
        tps = self.tokens * (steps if batches is None else batches) / self.world_size / seconds
        self._since, self._since_step = now, step
        return Window(seconds, steps, tps, 100 * tps * self.flops / self.peak)
