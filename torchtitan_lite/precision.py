"""Mixed precision: which dtype computes, and fp16's loss scaling.

Parameters, gradients and optimizer state stay float32; `training.mixed_precision_param` is the dtype matmuls run
in. Under FSDP the MixedPrecisionPolicy casts (parallelize.py); without it (one process, TP only) autocast does.

float16's range is narrow: small gradients underflow to zero. torch.amp.GradScaler multiplies the loss by a large
scale before backward, divides the gradients by it before clipping (so the norm and the clip see true gradients),
and skips the optimizer step when any gradient came out inf/NaN, halving the scale. FSDP2 needs no sharded scaler:
its gradients are DTensors, and DTensor reduces the inf check across the mesh, so every rank skips the same steps.
The scale is part of the training state: a resume that reset it would not continue the same curve.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

logger = logging.getLogger("torchtitan_lite")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def warn_if_slow(device: torch.device, dtype: torch.dtype) -> None:
    if device.type == "cpu" and dtype != torch.float32:
        logger.warning("training.mixed_precision_param = %s on a CPU: most CPUs (those without AMX) run "
                       "half-precision matmuls many times slower than float32; use float32 unless testing precision",
                       str(dtype)[6:])


class LossScaler(Stateful):
    """GradScaler when computing in float16, and a pass-through otherwise, so the loop has one shape. Counts the
    steps it skipped."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.enabled = dtype == torch.float16
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.enabled)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # on device: counting never syncs

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
        """The optimizer step, unless a gradient is inf/NaN; `grad_norm` (global, of the unscaled gradients) is
        non-finite exactly then, on every rank."""
        if self.enabled:
            self.skipped += ~torch.isfinite(grad_norm)
        self.scaler.step(optimizer)
        self.scaler.update()

    def metrics(self) -> dict[str, float]:
        """What metrics.jsonl records: the scale after this step's update, and the steps skipped so far."""
        return {"loss_scale": self.scaler.get_scale(), "skipped_steps": self.skipped.item()} if self.enabled else {}

    def state_dict(self) -> dict[str, Any]:
        return {**self.scaler.state_dict(), "skipped_steps": self.skipped.item()} if self.enabled else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.enabled:
            self.skipped.fill_(int(state.pop("skipped_steps")))
            self.scaler.load_state_dict(state)
