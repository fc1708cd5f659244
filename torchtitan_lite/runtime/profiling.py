"""torch.profiler traces of chosen steps, with the step's phases named in them, on any device.

A trace answers what a slow step spent its time on, per rank: which ops, which collectives, how long each phase
(phases.py names them) took. Tracing costs time and memory, so it runs on a cycle (torchtitan's `[profiling]` keys
and meaning): every `profile_freq` steps the profiler warms up for `profiler_warmup` steps, then records
`profiler_active` steps and writes one gzipped Chrome trace per rank,
`<save_traces_folder>/iteration_<step>/rank<R>_trace.json.gz`, named by the window's last global step. The cycle
counts global steps, so a resumed run traces the same steps an uninterrupted one would and continues the numbering;
a window the run ends inside is dropped rather than written under a step that never ran, and so is one a resumed run
enters after its first warm-up step, which would be traced with fewer warm-up steps than asked for.

On the CPU, `enable_memory_snapshot` adds the profiler's memory timeline of each window beside its trace
(`rank<R>_memory_timeline.json.gz`: bytes held per category, parameters, gradients, optimizer state, activations...),
in one process only (check_profiling says why); the GPU's allocator snapshots are memory_snapshot.py's.

Off, it costs nothing: `phase` hands out one shared null context and `step` returns at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from typing import Callable

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, record_function

from torchtitan_lite.config import ConfigError
from torchtitan_lite.config.sections import Profiling

logger = logging.getLogger("torchtitan_lite")
_OFF = contextlib.nullcontext()


def check_profiling(cfg: Profiling, world_size: int) -> None:
    """The cycle must hold its warmup and its traced steps, and the CPU's memory timeline a single process (train.py
    --check).

    torch's memory profiler sees the allocations and frees of the threads it profiles. gloo runs each collective on
    a thread of its own, whose work object holds the collective's tensors: when it holds the last reference (a copy
    it made of the input, as the functional reduce-scatter of TP's sequence parallelism does; a buffer the caller has
    dropped by the time the thread lets go), the tensor is freed there, unseen. The profiler then takes the next
    tensor allocated at that address for the freed one and rejects the window's data flow ("version mismatch",
    "duplicate outputs" in export_memory_timeline): on TP and FSDP layouts, on some ranks in most windows. The
    references are torch's, not ours, and profiling every thread (`profile_all_threads`) records no allocation at
    all in torch 2.13. One process, whose few collectives are the loop's own small ones (the signal flag, the logged
    losses and step times), has written its timeline in every run, exactly what the trainer holds
    (tests/test_profiling.py)."""
    if not cfg.enable_profiling:
        return
    if cfg.profile_freq < cfg.profiler_warmup + cfg.profiler_active:
        raise ConfigError(f"profiling.profile_freq = {cfg.profile_freq} is shorter than profiler_warmup + "
                          f"profiler_active = {cfg.profiler_warmup + cfg.profiler_active}: raise profile_freq or "
                          "lower the other two")
    if cfg.enable_memory_snapshot and world_size > 1 and not torch.cuda.is_available():
        raise ConfigError(f"profiling.enable_memory_snapshot on the CPU (the profiler's memory timeline) needs one "
                          f"process, not {world_size}: torch's memory profiler misses the frees on gloo's threads and "
                          "fails; profile memory in one process (NGPU=1, every parallelism degree 1), or profile "
                          "without --profiling.enable_memory_snapshot")


def cycle(cfg: Profiling, start_step: int) -> Callable[[int], ProfilerAction]:
    """The profiler's action for its n-th step (counted from 0) of a run that starts after `start_step`: the cycle
    read at the global step, so a resumed run traces the steps a straight run would, but for a window the run enters
    after its first warm-up step, which is skipped: its trace would lack warm-up (or traced) steps."""
    wait = cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active
    schedule = torch.profiler.schedule(wait=wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active)
    entered = start_step % cfg.profile_freq  # the first step's place in its window
    first = start_step - entered + cfg.profile_freq if entered > wait else start_step
    return lambda n: schedule(start_step + n) if start_step + n >= first else ProfilerAction.NONE


def trace_path(folder: str, step: int, rank: int, kind: str = "trace") -> str:
    return os.path.join(folder, f"iteration_{step}", f"rank{rank}_{kind}.json.gz")


class StepProfiler:
    """Traces the steps the cycle picks; `phase(name)` names a part of the step in the trace. Use as a context
    around the loop, and call `step()` after each training step."""

    def __init__(self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device, start_step: int):
        self.folder, self.rank, self.start_step = os.path.join(dump_folder, cfg.save_traces_folder), rank, start_step
        self._memory = cfg.enable_memory_snapshot and device.type == "cpu"
        self._prof, self._closing = None, False
        if not cfg.enable_profiling:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof = torch.profiler.profile(
            activities=activities, schedule=cycle(cfg, start_step), on_trace_ready=self._write,
            record_shapes=True, profile_memory=self._memory, with_stack=self._memory)  # the timeline's needs

    def __enter__(self) -> StepProfiler:
        if self._prof is not None:
            os.makedirs(self.folder, exist_ok=True)
            logger.info("profiling: traces of every step that is a multiple of profile_freq go to %s", self.folder)
            self._prof.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._closing = True  # stopping mid-window would write a trace of a step that never ran
            self._prof.stop()
            self._prof = None

    def phase(self, name: str):
        """A named range of the step in the trace (a null context when profiling is off)."""
        return _OFF if self._prof is None else record_function(name)

    def step(self) -> None:
        """After each training step: the profiler moves along its cycle, writing the traces of a finished window."""
        if self._prof is not None:
            self._prof.step()

    def _write(self, prof: torch.profiler.profile) -> None:
        if self._closing:
            return
        step, begin = self.start_step + prof.step_num, time.perf_counter()
        path = trace_path(self.folder, step, self.rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.export_chrome_trace(path)  # gzipped: the name ends in .gz
        if self._memory:
            with warnings.catch_warnings():  # deprecated for GPUs, in favour of memory_snapshot.py's snapshots
                warnings.simplefilter("ignore", FutureWarning)
                prof.export_memory_timeline(trace_path(self.folder, step, self.rank, "memory_timeline"), device="cpu")
        logger.info("profiling: step %d traced in %s (%.1fs)", step, os.path.dirname(path),
                    time.perf_counter() - begin)
