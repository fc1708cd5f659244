"""Numerics of the update: which dtype computes, fp16's loss scaling, and steps whose gradients are not finite.

Parameters, gradients and optimizer state stay float32; `training.mixed_precision_param` is the dtype matmuls run
in. Under FSDP the MixedPrecisionPolicy casts (parallelize.py); without it (one process, TP only) autocast does.

float16's range is narrow: small gradients underflow to zero. A loss scaler multiplies the loss by a large scale
before backward, divides the gradients by it before clipping (so the norm and the clip see true gradients), and
skips the optimizer step when any gradient came out inf/NaN, halving the scale. It is ours, not torch.amp.GradScaler,
because GradScaler decides per rank from the gradients it holds (DTensor reduces its inf check over a gradient's own
mesh, which never spans pipeline stages): one stage would skip and halve its scale while the others stepped. Ours
takes the job's one decision, the all-reduced gradient norm, so every rank skips the same steps and keeps the same
scale, on every layout. The scale is part of the training state: a resume that reset it would not continue the curve.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor


logger = logging.getLogger("torchtitan_lite")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def warn_if_slow(device: torch.device, dtype: torch.dtype) -> None:
    if device.type == "cpu" and dtype != torch.float32:
        logger.warning("training.mixed_precision_param = %s on a CPU: most CPUs (those without AMX) run "
                       "half-precision matmuls many times slower than float32; use float32 unless testing precision",
                       str(dtype)[6:])


def moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, by a blocking copy when it lives elsewhere. Under CPU offload the optimizer's tensors are on
    the host and the step's decision on the GPU: a non-blocking device-to-host copy (fused AdamW's own, of found_inf)
    returns before the value lands, and the host kernel would read whatever the buffer held. Offload waits for the
    device each step anyway (its gradients come to the host)."""
    return t if t.device == device else t.to(device, non_blocking=False)


class LossScaler:
    """fp16's dynamic loss scale, with torch.amp.GradScaler's factors and state-dict keys (so its checkpoints load),
    updated from a decision taken for the whole job instead of from this rank's gradients."""

    # GradScaler's defaults. The floor is Megatron's and DeepSpeed's min_loss_scale: at 1 the gradients are no longer
    # scaled, so an overflow there is not one a lower scale would avoid.
    init_scale, growth_factor, backoff_factor, growth_interval, min_scale = 2.0**16, 2.0, 0.5, 2000, 1.0

    def __init__(self, device: torch.device):
        self.scale = torch.full((), self.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)  # good steps in a row

    @torch.no_grad()
    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divides the gradients by the scale in place (their local shards: the scale is the same everywhere)."""
        inv_scale = self.scale.double().reciprocal().float()
        by_device = defaultdict(list)
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            by_device[local.device].append(local)
        for device, local in by_device.items():
            torch._foreach_mul_(local, moved(inv_scale, device))

    def update(self, overflow: torch.Tensor) -> torch.Tensor:
        """GradScaler's update from the job's decision `overflow`: halve the scale, or double it after
        growth_interval steps in a row without an overflow. The scale never falls below min_scale; returns whether
        this step overflowed there, on the device."""
        good = self.growth_tracker + 1
        grows = ~overflow & (good == self.growth_interval) & torch.isfinite(self.scale * self.growth_factor)
        at_floor = overflow & (self.scale * self.backoff_factor < self.min_scale)
        self.scale = torch.where(overflow & ~at_floor, self.scale * self.backoff_factor,
                                 torch.where(grows, self.scale * self.growth_factor, self.scale))
        self.growth_tracker = torch.where(overflow | (good == self.growth_interval), 0, good)
        return at_floor

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale.item(), "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self.growth_tracker.item()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale.fill_(state["scale"])
        self.growth_tracker.fill_(int(state["_growth_tracker"]))
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])


class UpdateGuard(Stateful):
    """Skips each optimizer step whose gradients are not finite, and counts the steps it skipped.

    The decision is the gradient norm's: all-reduced over the world, it is non-finite on every rank exactly when a
    gradient anywhere is, so every rank decides alike. In other precisions such a step means the update would poison
    the weights: the run stops, naming the step, or with `training.skip_nonfinite_steps = N` skips it and stops only at
    the (N+1)-th such step in a row. In float16 an overflow is routine: the step is skipped and the loss scale halved,
    without limit, until the scale reaches its floor (1); a step that overflows there is treated like a non-finite
    step in other precisions (stop, or skip up to N in a row), as DeepSpeed stops at its min_loss_scale. A diverged
    fp16 run thus stops about log2(scale) steps after it diverged, with the weights of before.

    The decision is a vote (`vote`), one of those the trainer's update takes (training/update.py; `step` applies it
    alone), and stays on the device (apply_or_skip). A step that must stop the run sets a latch that votes to skip
    every later update too, so the weights stay those from before that step until the host reads the latch, at the
    next logging step or checkpoint save (`check`), and raises.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, skip_nonfinite: int = 0):
        self.enabled = dtype == torch.float16  # loss scaling
        self.scaler = LossScaler(device) if self.enabled else None
        self.skip_nonfinite = skip_nonfinite
        zero = torch.zeros((), dtype=torch.int64, device=device)
        # On the device, read by the host only when it syncs anyway (logging, saving).
        self.skipped, self.in_a_row, self.stopped_at = zero.clone(), zero.clone(), zero.clone()
        self.stopped_norm = torch.zeros((), device=device)
        self.reported = 0  # skipped steps already warned about

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.enabled:
            self.scaler.unscale_([p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None])

    def vote(self, grad_norm: torch.Tensor, step: int) -> torch.Tensor:
        """Whether to skip this step's update, on the device: when a gradient is inf/NaN, which `grad_norm` (global,
        of the unscaled gradients) is exactly then, on every rank, or once the run has had to stop. Counts it."""
        bad = ~torch.isfinite(grad_norm)
        counted = self.scaler.update(bad) if self.enabled else bad  # fp16: only an overflow at the floor counts
        self.in_a_row = torch.where(counted, self.in_a_row + 1, 0)
        stops = (self.in_a_row > self.skip_nonfinite) & (self.stopped_at == 0)
        self.stopped_at = torch.where(stops, step, self.stopped_at)
        self.stopped_norm = torch.where(stops, grad_norm.float(), self.stopped_norm)
        stopped = self.stopped_at > 0
        self.skipped += bad & ~stopped
        return bad | stopped

    def check(self) -> None:
        """Raises NonFiniteError if a step since the last check had to stop the run; warns of skipped steps. Syncs
        with the device: call where the host waits anyway (logging, saving)."""
        if stopped_at := int(self.stopped_at.item()):
            floor = f" at fp16's lowest loss scale {self.scaler.min_scale}" if self.enabled else ""
            raise NonFiniteError(
                f"step {stopped_at}: the gradient norm is {self.stopped_norm.item()}{floor} (a NaN or Inf loss or "
                f"gradient); stopped before updating the weights ({self.skip_nonfinite + 1} such step(s) in a row, "
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
        return {**({"loss_scale": self.scaler.scale.item()} if self.enabled else {}),
                "skipped_steps": self.skipped.item()}

    def state_dict(self) -> dict[str, Any]:
        self.check()  # never save the state of a run that had to stop
        if not self.counts:
            return {}
        return {**(self.scaler.state_dict() if self.enabled else {}), "skipped_steps": self.skipped.item(),
                "in_a_row": self.in_a_row.item()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.counts:
            self.skipped.fill_(int(state.pop("skipped_steps")))
            self.in_a_row.fill_(int(state.pop("in_a_row")))
            self.reported = int(self.skipped.item())
            if self.enabled:
                self.scaler.load_state_dict(state)


def apply_or_skip(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """optimizer.step() unless `skip`, a bool on the device, is set, without the host waiting for it: fused AdamW takes
    it as its `found_inf` tensor and leaves weights, moments and step count untouched when it is set. Optimizers
    without `found_inf` (foreach, for-loop) read it on the host each step instead."""
    if optimizer.defaults.get("fused"):
        device = optimizer.param_groups[0]["params"][0].device  # the host's under CPU offload
        optimizer.found_inf, optimizer.grad_scale = moved(skip.float(), device), None
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
    elif not skip.item():
        optimizer.step()


class NonFiniteError(RuntimeError):
    """A step's loss or gradients were not finite and the run may not skip it: the message names the step."""
