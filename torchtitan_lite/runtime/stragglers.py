"""Which rank holds the others up: each rank's step time and data wait, set against the median rank's at every
logging step.

Ranks that train together wait for one another at every collective, so a slow rank makes every rank's step slow and
the step times alone rarely say which one it is. What stays a rank's own is the time it spends outside the shared
work: waiting for its data (a slow disk, a busy tokenizer, a node's noisy neighbour) above all. So each rank times
its data wait and its steps between two logging steps, and at the logging step one small all-gather of two numbers
per rank, on the host (the gloo group beside NCCL on a GPU), lets every rank see the slowest: the one whose step or
data wait exceeds the median rank's by the most. Nothing is read from the device, so the steps between logging steps
still never wait for it (tests/multiprocess/test_syncs.py). A rank that lags by more than `straggler_factor - 1`
median steps at PERSISTENT logging steps in a row is named in a warning, once a run.

Logged fields (rank 0's metrics.jsonl): `data_loading_s` and `data_loading_pct` (this rank's mean data wait per step,
and its share of the step: torchtitan's data-loading time), `median_step_s`, `median_data_loading_s`,
`slowest_rank`, `slowest_step_s`, `slowest_data_loading_s`.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

logger = logging.getLogger("torchtitan_lite")
PERSISTENT = 3
T = TypeVar("T")


def slowest(step_s: list[float], data_s: list[float]) -> tuple[int, float, dict[str, float]]:
    """(the slowest rank, its lag behind the median rank in seconds per step, the fields to log) from every rank's
    step time and data wait per step. A rank's lag is the larger of its step time's and its data wait's excess over
    the median's: a data wait is the rank's own however the collectives even out the step times."""
    median_step, median_data = statistics.median(step_s), statistics.median(data_s)
    lags = [max(s - median_step, d - median_data) for s, d in zip(step_s, data_s)]
    rank = max(range(len(lags)), key=lags.__getitem__)
    return rank, lags[rank], {"median_step_s": median_step, "median_data_loading_s": median_data,
                              "slowest_rank": rank, "slowest_step_s": step_s[rank], "slowest_data_loading_s": data_s[rank]}


class Stragglers:
    def __init__(self, group: dist.ProcessGroup | None, factor: float):
        self.group, self.factor, self.data_s = group, factor, 0.0
        self.world = dist.get_world_size(group)
        self._streak, self._warned = (None, 0), set()

    def timed_data(self, fetch: Callable[[], T]) -> T:
        """fetch(), its time counted as this rank's data wait."""
        begin = time.perf_counter()
        out = fetch()
        self.data_s += time.perf_counter() - begin
        return out

    def fields(self, window_s: float, steps: int) -> dict[str, float]:
        """At a logging step, on every rank: the fields to log for the `steps` steps that took `window_s`."""
        own_step, own_data = window_s / steps, self.data_s / steps
        self.data_s = 0.0
        everyone = [torch.empty(2, dtype=torch.float64) for _ in range(self.world)]
        # A list all-gather, not all_gather_into_tensor: it stays apart from FSDP's in a trace's collective counts.
        dist.all_gather(everyone, torch.tensor([own_step, own_data], dtype=torch.float64), group=self.group)
        step_s, data_s = zip(*(t.tolist() for t in everyone))  # host tensors: no device sync
        rank, lag, fields = slowest(list(step_s), list(data_s))
        median = fields["median_step_s"]
        slow = lag > (self.factor - 1) * median
        self._streak = (rank, self._streak[1] + 1 if self._streak[0] == rank else 1) if slow else (None, 0)
        if self._streak[1] >= PERSISTENT and rank not in self._warned:
            self._warned.add(rank)
            logger.warning("rank %d is a straggler: step %.3fs, data wait %.3fs, against the median rank's %.3fs and "
                           "%.3fs, at %d logging steps in a row (metrics.straggler_factor %g)", rank, step_s[rank],
                           data_s[rank], median, fields["median_data_loading_s"], self._streak[1], self.factor)
        return {"data_loading_s": own_data, "data_loading_pct": 100 * own_data / own_step, **fields}
