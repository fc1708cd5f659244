"""Numerics of the update: which dtype computes, fp16's loss scaling, and steps whose gradients are not finite.

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


class UpdateGuard(Stateful):
    """Applies each optimizer step, or skips it when its gradients are not finite, and counts the steps it skipped.

    In float16 that is GradScaler's work: it scales the loss, unscales the gradients, skips overflowed steps and lowers
    the scale; overflow is routine there. In other precisions a NaN or Inf gradient norm (a NaN loss gives one) means
    the update would poison the weights: the run stops before it is applied, naming the step, or with
    `training.skip_nonfinite_steps = N` skips it and stops only at the (N+1)-th such step in a row. The norm is
    global (all-reduced), so every rank decides alike. Knowing it costs one host sync per step, before the update.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, skip_nonfinite: int = 0):
        self.enabled = dtype == torch.float16  # loss scaling
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.enabled)
        self.skip_nonfinite, self.in_a_row = skip_nonfinite, 0
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # on device: counting fp16 skips never syncs

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, step: int) -> None:
        """The optimizer step, unless a gradient is inf/NaN; `grad_norm` (global, of the unscaled gradients) is
        non-finite exactly then, on every rank."""
        if self.enabled:
            self.skipped += ~torch.isfinite(grad_norm)
            self.scaler.step(optimizer)
            self.scaler.update()
            return
        if torch.isfinite(grad_norm):
            self.in_a_row = 0
            optimizer.step()
            return
        self.in_a_row += 1
        if self.in_a_row > self.skip_nonfinite:
            raise NonFiniteError(
                f"step {step}: the gradient norm is {grad_norm.item()} (a NaN or Inf loss or gradient); stopped before "
                f"updating the weights ({self.in_a_row} such step(s) in a row, training.skip_nonfinite_steps = "
                f"{self.skip_nonfinite}). Resume from the last checkpoint with a lower optimizer.lr or "
                f"training.max_norm, or set training.skip_nonfinite_steps to skip such steps")
        self.skipped += 1
        logger.warning("step %d: gradient norm %s, update skipped (%d in a row of at most %d)", step,
                       grad_norm.item(), self.in_a_row, self.skip_nonfinite)

    @property
    def counts(self) -> bool:
        return self.enabled or self.skip_nonfinite > 0

    def metrics(self) -> dict[str, float]:
        """What metrics.jsonl records: the skipped steps so far, and in fp16 the scale after this step's update."""
        if not self.counts:
            return {}
        return {**({"loss_scale": self.scaler.get_scale()} if self.enabled else {}),
                "skipped_steps": self.skipped.item()}

    def state_dict(self) -> dict[str, Any]:
        if not self.counts:
            return {}
        return {**self.scaler.state_dict(), "skipped_steps": self.skipped.item(), "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.counts:
            self.skipped.fill_(int(state.pop("skipped_steps")))
            self.in_a_row = int(state.pop("in_a_row"))
            self.scaler.load_state_dict(state)


class NonFiniteError(RuntimeError):
    """A step's loss or gradients were not finite and the run may not skip it: the message names the step."""
