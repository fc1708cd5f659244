"""The tracker that tools/memory.py runs the trainer's step under: torch's MemTracker (FSDPMemTracker under FSDP),
keeping the peak of what the device holds and, for memory_extrapolate.py, the peak of each block's forward and of
each block's backward."""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor._sharding_prop import ShardingPropagator

STATE = ("SHARDED_PARAM", "BUFFER", "SHARDED_GRAD", "OPT")  # what a rank holds between steps
UNSHARDED = {"PARAM": "SHARDED_PARAM", "GRAD": "SHARDED_GRAD"}  # MemTracker's names for them, without FSDP
# ModTracker's name of a block, or of a module inside one: the root's class, then the module path (`layers.3.ffn`).
BLOCK = re.compile(r"[^.]+\.layers\.(\d+)(?:\.|$)")


class DevicePeak:
    """Mixed into torch's MemTracker (FSDPMemTracker under FSDP, which requires it): keeps the peak of what the
    device holds (without the `host` categories), and ignores DTensor's shape propagation.

    DTensor derives an op's output shape by running it on fake tensors of the global shape, in the active fake mode,
    which is ours: loss parallel's log-softmax alone would count as a (tokens x full vocab) fp32 tensor. Those ops
    run under ShardingPropagator._fake_mode_lock (a no-op context by default), so the tracker swaps in a context of
    its own that pauses it.

    With `segments`, it also keeps the peak of each segment of the step, (bytes, transient bytes) in the order the
    segments first ran: ("forward", i) from block i's forward on, ("backward", i) from block i's backward on, each
    until the next block's; None before the first block. So the loss, and the backward until the last block's, are
    the last block's forward, and gradient clipping the first block's backward. The step's peak is the first of the
    highest.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, host: tuple[str, ...],
                 segments: bool = False):
        if isinstance(self, FSDPMemTracker):
            super().__init__(model, optimizer)
        else:
            super().__init__()
            self.track_external(model, optimizer)
        self.host, self.device_peak, self.device_snap, self.paused = host, 0, {}, False
        self.segments: dict | None = {} if segments else None
        self.segment = None

    def reset_peaks(self) -> None:
        """The measured step starts: its peaks only (and no per-module statistics, which nothing reads)."""
        self.reset_mod_stats()
        self.device_peak = 0
        if self.segments is not None:
            self.segments, self.segment = {}, None

    def transient(self, peak: int, snap: dict[str, int]) -> int:
        """At a peak of `peak` bytes, what is neither state nor activation (the state is the host's under offload)."""
        return peak - (0 if self.host else sum(snap[k] for k in STATE)) - snap["ACT"]

    def __enter__(self):
        # torch 2.11 (the GPU machines') has no such lock: there the estimate also counts DTensor's propagation,
        # which only loss parallel makes large.
        self._saved_lock = getattr(ShardingPropagator, "_fake_mode_lock", None)
        if self._saved_lock is not None:
            ShardingPropagator._fake_mode_lock = self._Pause(self)
        return super().__enter__()

    def __exit__(self, *exc):
        if self._saved_lock is not None:
            ShardingPropagator._fake_mode_lock = self._saved_lock
        return super().__exit__(*exc)

    class _Pause:
        def __init__(self, tracker: DevicePeak):
            self.tracker = tracker

        def __enter__(self):
            self.tracker.paused = True

        def __exit__(self, *exc):
            self.tracker.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_peak_stats(self, peak_state) -> None:
        # Not torch's: after every op it walks every module's statistics (per-module peaks, which nothing here
        # reads), most of an estimate's time (docs/performance.md).
        if self._in_opt:
            return  # under fake tensors an in-place optimizer kernel allocates its outputs anew: not real memory
        on_device = self._on_device()
        if self.segments is not None:
            self._segment_peak(on_device)
        if on_device > self.device_peak:  # most ops make no new peak, and now() costs more
            self.device_peak, self.device_snap = on_device, self.now()

    def _on_device(self) -> int:
        total = 0
        for snap in self._curr_mem_snap.values():
            total += snap["Total"]
            if self.host:  # under offload the state is the host's: not the device's
                total -= sum(size for kind, size in snap.items() if self._name(kind) in self.host)
        return total

    def _segment_peak(self, on_device: int) -> None:
        blocks = [int(m[1]) for name in self._mod_tracker.parents if (m := BLOCK.match(name))]
        if blocks:  # two at once where one block's backward hands over to the next: the one starting
            self.segment = ("backward", min(blocks)) if self._mod_tracker.is_bw else ("forward", max(blocks))
        peak = self.segments.get(self.segment)
        if peak is None or on_device > peak[0]:
            self.segments[self.segment] = on_device, self.transient(on_device, self.now())

    def now(self) -> dict[str, int]:
        """Bytes alive by category, under FSDPMemTracker's names (MemTracker's PARAM and GRAD are unsharded)."""
        out = dict.fromkeys(("SHARDED_PARAM", "BUFFER", "SHARDED_GRAD", "ACT", "OPT", "Total"), 0)
        for snap in self._curr_mem_snap.values():
            for kind, size in snap.items():
                name = self._name(kind)
                out[name] = out.get(name, 0) + size
        return out

    @staticmethod
    def _name(kind) -> str:
        name = getattr(kind, "name", kind)  # an enum member, or "Total"
        return UNSHARDED.get(name, name)


class FSDPTracker(DevicePeak, FSDPMemTracker):
    pass


class Tracker(DevicePeak, MemTracker):
    """Without per-module statistics, which nothing here reads and which torch keeps for one forward per module per
    step: a pipeline stage runs one per micro-batch."""

    def _pre_fw_hook(self, *args):
        pass

    _post_fw_hook = _pre_bw_hook = _post_bw_hook = _pre_fw_hook
