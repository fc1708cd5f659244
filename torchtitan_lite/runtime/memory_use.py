"""What a logged record says of memory: the peak since the previous record, the bytes held for training state, and
on a GPU the caching allocator's counters (metrics.py measures each).

The state held (parameters, gradients, optimizer moments) is measured once, after the first step's backward and
update and before its gradients are freed: the optimizer's state exists only from its first step, and the gradients
only until zero_grad. It goes in the next record; later records leave it out, as it no longer changes. The GPU's peak
is reset after each record, so that each record's peak is its own steps'.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_lite.runtime.metrics import allocator_fields, held_bytes, memory_gib


class MemoryUse:
    def __init__(self, device: torch.device):
        self.device, self._held = device, {}

    def measure_held(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """After the first step's update, before zero_grad."""
        self._held = held_bytes(model, optimizer)

    def fields(self) -> dict[str, float]:
        """memory_gib, the state held when just measured, and the allocator's counters; reads the host's counters
        only (no device sync)."""
        fields = {"memory_gib": memory_gib(self.device), **self._held, **allocator_fields(self.device)}
        self._held = {}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return fields
