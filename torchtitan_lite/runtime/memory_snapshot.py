"""GPU memory snapshots: what held the device's memory, allocation by allocation, with the Python stack of each.

With `profiling.enable_memory_snapshot` on a GPU, the caching allocator records its history from the start
(`torch.cuda.memory._record_memory_history`), and every `profile_freq` steps each rank writes
`<save_memory_snapshot_folder>/iteration_<step>/rank<R>_memory_snapshot.pickle`, which https://pytorch.org/memory_viz
draws (torchtitan's layout and names). A step that runs out of device memory writes one more, `iteration_<step>_exit`,
whether or not the history was on (without it the snapshot still shows every block held, without their stacks), and
the run ends with one line naming the file and scripts/estimate_memory.py, instead of torch's page-long message: the
snapshot says what filled the memory, the estimator what each layout and batch would need. Under pipeline
parallelism the error arrives as the cause of torch's RuntimeError (the schedule wraps a stage's errors), so the
error's causes are searched.

The CPU build has these calls but no device behind them; on the CPU the profiler's memory timeline stands in
(profiling.py). The tests stub the device module.
"""

from __future__ import annotations

import logging
import os

import torch

from torchtitan_lite.config.sections import Profiling

logger = logging.getLogger("torchtitan_lite")
MAX_ENTRIES = 100_000  # allocator events kept (a ring buffer): how far back a snapshot sees, and its size


class OutOfMemory(RuntimeError):
    """A step ran out of device memory; the message is the one line the user reads."""


def out_of_memory(error: BaseException | None) -> bool:
    """Whether `error` is an out-of-memory error or was raised from one: torch's pipelining raises a RuntimeError
    from whatever a stage's forward or backward raised."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, torch.OutOfMemoryError):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


class MemorySnapshots:
    """Use as a context around the training loop (an exit that is an out-of-memory error writes the last snapshot)
    and call `step(n)` after each step."""

    def __init__(self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device, config_file: str):
        self.folder = os.path.join(dump_folder, cfg.save_memory_snapshot_folder)
        self.rank, self.freq, self.config_file, self.last_step = rank, cfg.profile_freq, config_file, 0
        self.cuda = device.type == "cuda"
        self.recording = self.cuda and cfg.enable_memory_snapshot

    def __enter__(self) -> MemorySnapshots:
        if self.recording:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
        return self

    def step(self, step: int) -> None:
        self.last_step = step
        if self.recording and step % self.freq == 0:
            self.dump(f"iteration_{step}")

    def dump(self, name: str) -> str:
        path = os.path.join(self.folder, name, f"rank{self.rank}_memory_snapshot.pickle")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.cuda.memory._dump_snapshot(path)
        return path

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.cuda and out_of_memory(exc):
                step = self.last_step + 1  # the step that failed
                path = self.dump(f"iteration_{step}_exit")
                raise OutOfMemory(
                    f"rank {self.rank}: out of GPU memory in step {step}: what held it is in {path} (open it in "
                    f"https://pytorch.org/memory_viz); python scripts/estimate_memory.py --job.config_file "
                    f"{self.config_file or 'FILE'} [overrides] gives each rank's need by layout and batch") from None
        finally:
            if self.recording:
                torch.cuda.memory._record_memory_history(enabled=None)
