"""The step's phases, each named once for the two tools that name where a step is.

A profiler trace shows how long each part of a step took (profiling.py); a hang's error line says which part of the
step the waiting rank was in (flight_recorder.py). Both need the same boundaries, so the loop names a phase once,
`with phase("optimizer"):`, and that one call opens the trace's range and sets the point a hang names. The table
below is the whole vocabulary: a new phase is a line here and a `with` in the loop.

A phase without a point leaves the point to code deeper in it, which names it finer: the forward and backward of each
block, a pipeline's send and receive (step.py, pipeline.py). Data loading runs no collective, so no hang is ever
named there.
"""

from __future__ import annotations

from torchtitan_lite.runtime import flight_recorder
from torchtitan_lite.runtime.profiling import StepProfiler

# Each phase's name in the trace -> the point a hang inside it is named by, in the words of the error line.
POINTS: dict[str, str | None] = {
    "data": None,
    "forward_backward": None,
    "optimizer": "the gradient norm's all-reduce",
    "validation": "validation",
    "log": "the loss all-reduce of a logging step",
    "checkpoint": "a checkpoint save",
    "signals": "the end of step agreement on signals",
}


class Phases:
    """`phase(name)`: a context that names a part of the step in the trace and, where the table says, for a hang."""

    def __init__(self, profiler: StepProfiler):
        self.profiler = profiler

    def __call__(self, name: str):
        if point := POINTS[name]:
            flight_recorder.at(point)  # looked up at each call: tests stop a rank at a named point by patching it
        return self.profiler.phase(name)
