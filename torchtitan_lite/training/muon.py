"""Muon: Newton-Schulz-orthogonalized momentum on the hidden matrices, AdamW on every other parameter, in one
optimizer (optimizer.name Muon).

The update of a matrix is a function of the whole matrix, which FSDP and TP hold in shards: a Newton-Schulz step on a
shard is another update, with a plausible curve. So each matrix's update is gathered whole (DTensor.full_tensor), one
rank of the matrix's mesh orthogonalizes it (the owners take the matrices in turn, so no rank orthogonalizes all of
them), and the others get the result by a sum over the mesh of the owner's result and everyone else's zeros (exact),
then keep their own piece of it. Every layout then applies the single process's update to its shards, to reduction
order in the gradients. A routed experts' 3-D weight is a stack of matrices, each orthogonalized on its own.

The math is torch.optim.Muon's (Keller Jordan's quintic Newton-Schulz, torch's coefficients and step count, Nesterov
momentum, decoupled weight decay at the unadjusted lr, and its two lr adjustments), in fp32 where torch's runs the
iteration in bf16 (`ns_dtype`: tests/test_muon.py checks ours against torch's in bf16, bitwise). The AdamW groups are
training/optim.py's AdamW, untouched: fused, its found_inf honoured, which the Muon groups honour too (a skipped step
changes nothing, decided on the device).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan_lite.training.optim import AdamW

# torch.optim.Muon's defaults: the quintic's coefficients and its steps.
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
NS_STEPS = 5


def zeropower(g: torch.Tensor, coefficients: Sequence[float] = NS_COEFFICIENTS, steps: int = NS_STEPS,
              eps: float = 1e-7, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The Newton-Schulz orthogonalization of the matrix `g` (torch.optim.Muon's, in `dtype`), in g's dtype."""
    a, b, c = coefficients
    x = g.to(dtype)
    if g.size(0) > g.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    # Contiguous: a collective reads a tensor's storage in order, which a tall matrix's transpose is not.
    return (x.T if g.size(0) > g.size(1) else x).to(g.dtype).contiguous()


def adjusted_lr(lr: float, rule: str, shape: Sequence[int]) -> float:
    """The lr of a (rows, cols) matrix's orthogonalized update: "original" (Keller Jordan's sqrt(max(1, rows/cols)))
    or "match_rms_adamw" (Moonlight's 0.2 sqrt(max(rows, cols)), an update of AdamW's RMS, so that AdamW's lr and
    weight decay carry over)."""
    rows, cols = shape[-2:]
    return lr * (0.2 * math.sqrt(max(rows, cols)) if rule == "match_rms_adamw" else math.sqrt(max(1, rows / cols)))


class Muon(AdamW):
    """Param groups with `"muon": True` take Muon's update (momentum, nesterov, ns_coefficients, ns_steps, ns_eps,
    adjust_lr, ns_dtype: their settings), the others AdamW's."""

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Muon takes no closure"
        groups = self.param_groups
        try:  # AdamW's step over its own groups, as AdamW alone would take it
            self.param_groups = [g for g in groups if not g.get("muon")]
            super().step()
        finally:
            self.param_groups = groups
        skip = getattr(self, "found_inf", None)  # apply_or_skip's, with fused AdamW: the step is skipped where set
        owners: dict = {}  # mesh -> the matrices of it orthogonalized so far this step
        for group in groups:
            if group.get("muon"):
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, group, skip, owners)

    def _update(self, p: torch.Tensor, group: dict, skip: torch.Tensor | None, owners: dict) -> None:
        g = p.grad
        if isinstance(g, DTensor) and g.placements != p.placements:
            g = g.redistribute(p.device_mesh, p.placements)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            # A step count as AdamW's states have (its load_state_dict reads every state's), on the device that
            # decides a skip: counting one costs no sync.
            state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
        buf = state["momentum_buffer"]
        new_buf = buf.lerp(g, 1 - group["momentum"])
        update = g.lerp(new_buf, group["momentum"]) if group["nesterov"] else new_buf
        ortho = self._orthogonalized(update, group, owners)
        lr = group["lr"]
        new_p = p.mul(1 - lr * group["weight_decay"]).add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr"], p.shape))
        new_buf, new_p = _local(new_buf), _local(new_p)
        if skip is not None:  # decided on the device: no host sync
            keep = skip.to(torch.bool)
            new_buf, new_p = torch.where(keep, _local(buf), new_buf), torch.where(keep, _local(p), new_p)
        _local(buf).copy_(new_buf)
        _local(p).copy_(new_p)
        state["step"] += 1 if skip is None else 1 - skip

    def _orthogonalized(self, update: torch.Tensor, group: dict, owners: dict) -> torch.Tensor:
        """The orthogonalized update, laid out as `update` (this rank's piece of a DTensor)."""
        def ortho(full: torch.Tensor) -> torch.Tensor:
            ns = (group["ns_coefficients"], group["ns_steps"], group["ns_eps"], group["ns_dtype"])
            return zeropower(full, *ns) if full.dim() == 2 else torch.stack([zeropower(m, *ns) for m in full])

        if not isinstance(update, DTensor):  # held whole by this rank alone
            return ortho(update)
        mesh = update.device_mesh
        # On the mesh's device: under CPU offload the update lives on the host, NCCL does not (a no-op elsewhere).
        home, update = update.device, update.to(mesh.device_type)
        full = update.full_tensor()
        turn = owners.get(mesh, 0)  # the mesh as its key: hashed once, where its ranks would be a read of a tensor
        owners[mesh] = turn + 1
        mine = _linear(mesh.get_coordinate(), mesh.shape) == turn % mesh.size()
        result = ortho(full) if mine else torch.zeros_like(full)
        for dim in range(mesh.ndim):  # the owner's result everywhere: a sum with zeros, exact
            if mesh.size(dim) > 1:
                dist.all_reduce(result, group=mesh.get_group(dim))
        return distribute_tensor(result, mesh, update.placements, src_data_rank=None).to(home)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _linear(coordinate: list[int], shape: Sequence[int]) -> int:
    index = 0
    for c, n in zip(coordinate, shape):
        index = index * n + c
    return index
