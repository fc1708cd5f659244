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

from torchtitan_lite.config import ConfigError

logger = logging.getLogger("torchtitan_lite")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def warn_if_slow(device: torch.device, dtype: torch.dtype) -> None:
    if device.type == "cpu" and dtype != torch.float32:
        logger.warning("training.mixed_precision_param = %s on a CPU: most CPUs (those without AMX) run "
                       "half-precision matmuls many times slower than float32; use float32 unless testing precision",
                       str(dtype)[6:])


def check_precision(dtype: str, pp: int) -> None:
    """Refuses what the loss scaler cannot run yet: under a pipeline only the last stage computes the loss, so the
    scaler never scales on the other stages and fails there at the first unscale."""
    if dtype == "float16" and pp > 1:
        raise ConfigError("training.mixed_precision_param float16 is not supported with pipeline_parallel_degree > 1 "
                          "yet (the loss scaler runs on the last stage only): use bfloat16 or float32 under PP")


class UpdateGuard(Stateful):
    """Applies each optimizer step, or skips it when its gradients are not finite, and counts the steps it skipped.

    In float16 that is GradScaler's work: it scales the loss, unscales the gradients, skips overflowed steps and lowers
    the scale; overflow is routine there. In other precisions a NaN or Inf gradient norm (a NaN loss gives one) means
    the update would poison the weights: the run stops, naming the step, or with `training.skip_nonfinite_steps = N`
    skips it and stops only at the (N+1)-th such step in a row. The norm is global (all-reduced), so every rank
    decides alike.

    The decision stays on the device, so a step never waits for the host: fused AdamW takes a `found_inf` tensor (as
    GradScaler passes it) and leaves weights, moments and step count untouched when it is set. A step that must stop
    the run sets a latch that skips every later update too, so the weights stay those from before that step until
    the host reads the latch, at the next logging step or checkpoint save (`check`), and raises. Optimizers without
    `found_inf` (foreach, for-loop) read the flag on the host each step instead.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, skip_nonfinite: int = 0):
        self.enabled = dtype == torch.float16  # loss scaling
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.enabled)
        self.skip_nonfinite = skip_nonfinite
        zero = torch.zeros((), dtype=torch.int64, device=device)
        # On the device, read by the host only when it syncs anyway (logging, saving).
        self.skipped, self.in_a_row, self.stopped_at = zero.clone(), zero.clone(), zero.clone()
        self.stopped_norm = torch.zeros((), device=device)
        self.reported = 0  # skipped steps already warned about

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, step: int) -> None:
        """The optimizer step, unless a gradient is inf/NaN; `grad_norm` (global, of the unscaled gradients) is
        non-finite exactly then, on every rank."""
        bad = ~torch.isfinite(grad_norm)
        if self.enabled:
            self.skipped += bad
            self.scaler.step(optimizer)  # with fused AdamW, found_inf goes to the kernel: no host sync
            self.scaler.update()
            return
        self.in_a_row = torch.where(bad, self.in_a_row + 1, 0)
        stops = (self.in_a_row > self.skip_nonfinite) & (self.stopped_at == 0)
        self.stopped_at = torch.where(stops, step, self.stopped_at)
        self.stopped_norm = torch.where(stops, grad_norm.float(), self.stopped_norm)
        stopped = self.stopped_at > 0
        self.skipped += bad & ~stopped
        skip = bad | stopped
        if optimizer.defaults.get("fused"):
            optimizer.found_inf, optimizer.grad_scale = skip.float(), None
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf, optimizer.grad_scale
        elif not skip.item():
            optimizer.step()

    def check(self) -> None:
        """Raises NonFiniteError if a step since the last check had to stop the run; warns of skipped steps. Syncs
        with the device: call where the host waits anyway (logging, saving)."""
        if stopped_at := int(self.stopped_at.item()):
            raise NonFiniteError(
                f"step {stopped_at}: the gradient norm is {self.stopped_norm.item()} (a NaN or Inf loss or gradient); "
                f"stopped before updating the weights ({self.skip_nonfinite + 1} such step(s) in a row, "
                f"training.skip_nonfinite_steps = {self.skip_nonfinite}). Resume from the last checkpoint with a lower "
                f"optimizer.lr or training.max_norm, or set training.skip_nonfinite_steps to skip such steps")
        if not self.enabled and self.skip_nonfinite and (skipped := int(self.skipped.item())) > self.reported:
            logger.warning("%d update(s) skipped since the last log: gradient norm not finite (%d in all, at most %d "
                           "in a row)", skipped - self.reported, skipped, self.skip_nonfinite)
            self.reported = skipped

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
        self.check()  # never save the state of a run that had to stop
        if not self.counts:
            return {}
        return {**self.scaler.state_dict(), "skipped_steps": self.skipped.item(), "in_a_row": self.in_a_row.item()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.counts:
            self.skipped.fill_(int(state.pop("skipped_steps")))
            self.in_a_row.fill_(int(state.pop("in_a_row")))
            self.reported = int(self.skipped.item())
            self.scaler.load_state_dict(state)


class NonFiniteError(RuntimeError):
    """A step's loss or gradients were not finite and the run may not skip it: the message names the step."""
