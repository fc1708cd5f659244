"""AdamW, the learning-rate schedule and gradient clipping (optimizers.py chooses the optimizer by name)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_lite.config import LRScheduler, Optimizer

logger = logging.getLogger("torchtitan_lite")


def adamw_settings(cfg: Optimizer, device_type: str) -> dict[str, Any]:
    """torch AdamW's keyword arguments for the [optimizer] keys, lr aside."""
    impl = cfg.implementation
    if impl == "fused" and device_type == "cpu" and not _fused_on_cpu():
        impl = "foreach"  # fused AdamW has no CPU kernel on older torch; foreach is the next fastest
    return {"betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
            "foreach": impl == "foreach", "fused": impl == "fused" or None}


class AdamW(torch.optim.AdamW):
    """torch's AdamW, except that a loaded state keeps this run's settings: betas, eps, weight decay and kernel are
    the config's, not the checkpoint's. torch's load_state_dict takes them all from the checkpoint, so a resume under
    another weight decay (a cooldown, say) would silently train with the old one. The lr stays the checkpoint's: the
    schedule, loaded next, decides it (LRSchedule). One line says what changed."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["param_groups"]
        ours = [{k: v for k, v in g.items() if k not in ("params", "param_names", "lr", "initial_lr")}
                for g in self.param_groups]
        was, now = _settings(saved[0]), _settings(self.param_groups[0])
        # Merged before loading: torch places the loaded state (the step counters) as the groups' kernel needs it.
        super().load_state_dict({**state_dict, "param_groups": [{**s, **o} for s, o in zip(saved, ours)]})
        changed = [f"optimizer.{k} {was[k]} -> {v}" for k, v in now.items() if was[k] != v]
        if changed and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.info("the optimizer's settings changed since the checkpoint (%s): the resumed steps use the new "
                        "ones", ", ".join(changed))


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings as the config names them."""
    impl = "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"
    return {"beta1": group["betas"][0], "beta2": group["betas"][1], "eps": group["eps"],
            "weight_decay": group["weight_decay"], "implementation": impl}


@functools.cache
def _fused_on_cpu() -> bool:
    try:
        p = torch.zeros(1, requires_grad=True)
        p.grad = torch.zeros(1)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except RuntimeError:
        return False


def lr_factor(step: int, warmup: int, decay: int, total: int, decay_type: str, min_factor: float) -> float:
    """Multiplier of the base lr after `step` optimizer steps: linear warmup, a stable phase, then decay.

    Warmup counts from 1 so the first step trains (lr = base / warmup, not 0). The decay falls from 1 to
    `min_factor` over the last `decay` steps and reaches it when they are done: the last step trains one decay step
    above it, not at `min_factor` (at 0 it would be wasted). These are torchtitan's values step for step.
    """
    if step < warmup:
        return (step + 1) / warmup
    stable_end = total - decay
    if step < stable_end or decay == 0:
        return 1.0
    progress = min(1.0, (step - stable_end) / decay)
    shape = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress),
             "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[decay_type]
    return min_factor + (1 - min_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, steps: int) -> LRSchedule:
    warmup = min(cfg.warmup_steps, steps)
    decay = steps - warmup if cfg.decay_ratio is None else round(cfg.decay_ratio * steps)
    decay = min(decay, steps - warmup)  # warmup and decay cannot overlap; a too-large ratio shortens decay
    fn = functools.partial(lr_factor, warmup=warmup, decay=decay, total=steps, decay_type=cfg.decay_type,
                           min_factor=cfg.min_lr_factor)
    settings = {"training.steps": steps, "optimizer.lr": optimizer.param_groups[0]["lr"],
                **{f"lr_scheduler.{k}": v for k, v in dataclasses.asdict(cfg).items()}}
    return LRSchedule(optimizer, fn, settings)


class LRSchedule(LambdaLR):
    """torch's LambdaLR, saving the settings it was built from as well, so that a resume under other ones (a finished
    run extended with more training.steps, another decay or lr) follows the new schedule from its first step.

    LambdaLR alone would not: the first resumed step trains at the lr the checkpoint's optimizer holds, the old
    schedule's (0 after a finished run's decay), and only the steps after it follow the new one. When nothing
    changed, the lr loaded is the one this schedule gives, bit for bit, and is left alone.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, factor, settings: dict[str, Any]):
        self.settings = settings
        super().__init__(optimizer, factor)

    def state_dict(self) -> dict[str, Any]:
        # A copy: DCP loads into the dict it is handed, which must not overwrite the settings this run was built from.
        return {**super().state_dict(), "settings": dict(self.settings)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads after the optimizer (checkpoint/manager.py), whose param groups then hold the checkpoint's lr."""
        state = dict(state)
        saved, ours, base = state.pop("settings", {}), self.settings, list(self.base_lrs)
        super().load_state_dict(state)
        step, groups = self.last_epoch, self.optimizer.param_groups
        lrs = [b * fn(step) for fn, b in zip(self.lr_lambdas, base)]  # LambdaLR's own expression: the same bits
        # A checkpoint from before schedules saved their settings leaves ours in place (check_fits): its lr tells.
        changed = [f"{k} {saved[k]} -> {v}" for k, v in ours.items() if saved.get(k, v) != v]
        if not changed and lrs == [g["lr"] for g in groups]:
            return
        loaded = groups[0]["lr"]
        self.base_lrs, self._last_lr = base, lrs
        for group, lr, b in zip(groups, lrs, base):
            group["lr"], group["initial_lr"] = lr, b
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("the lr schedule changed since the checkpoint (%s): the lr of step %d follows the new "
                        "schedule", ", ".join(changed) or f"lr {loaded:g} -> {lrs[0]:g}", step + 1)


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, world_size: int,
                    uncounted: list[torch.Tensor] = (), in_float32: bool = False) -> torch.Tensor:
    """Clip the global gradient norm of parameters that may live on different meshes (or be plain tensors).

    torch.nn.utils.clip_grad_norm_ cannot mix meshes, so each rank sums the squares of its local gradient shards,
    weighted by 1 / (number of ranks holding that same shard), and one all-reduce over the world adds them up (over
    pipeline stages too, whose parameters are disjoint: a plain tensor is held by its stage's rank alone).
    Returns the total norm (before clipping), in float64. max_norm = 0 only measures. `uncounted`: parameters of
    `params` that another rank counts (a tied parameter's copy on the last pipeline stage: parallel/stage_ties.py),
    clipped but not counted here. `in_float32` (training.layout_invariant) rounds the total to float32 before it
    clips or is logged: layouts that split the squares differently differ in float64's last bits, not float32's.

    Each tensor's norm is accumulated in float64: the CPU's float32 norm sums a tensor in long sequential runs, whose
    rounding error grows with its size, so two layouts that split the same gradients differently would log (and
    clip by) norms further apart than their gradients are.
    """
    for p in params:
        # Under TP without FSDP, a replicated weight used on sequence shards (the norms) gets a Partial gradient:
        # sum it across ranks now, so both the norm and the optimizer see the true gradient.
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    # Summed on the process group's device: under CPU offload the gradients live on the host, NCCL does not.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    skip = {id(p.grad) for p in uncounted}
    for g, norm in zip(grads, torch._foreach_norm(local, 2.0, dtype=torch.float64) if local else []):
        if id(g) not in skip:
            sq += norm.to(device) ** 2 * _share(g)
    if world_size > 1:
        dist.all_reduce(sq)
    total = sq.sqrt()
    if in_float32:
        total = total.float().double()
    if max_norm > 0 and local:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(local, coef.to(local[0].device, local[0].dtype))
    return total


def _share(t: torch.Tensor) -> float:
    """1 / how many ranks hold a copy of this rank's piece of the tensor."""
    if not isinstance(t, DTensor):
        return 1.0
    # FSDP on top of TP shards a dim twice; the outer split is a _StridedShard, which is not a Shard subclass.
    mesh = t.device_mesh
    pieces = math.prod(mesh.size(i) for i, p in enumerate(t.placements) if isinstance(p, (Shard, _StridedShard)))
    return pieces / mesh.size()
