"""Parameters the first and last pipeline stages both hold (tied embeddings: the embedding table is the output
projection's weight; multi-token prediction's modules embed tokens too), kept one parameter across the stages.

Both stages start from the same values (initialization and checkpoints name the parameter alike on every stage:
pipeline.split_stages) and take the same update when they hold the same gradient: the sum of the two stages'
gradients, the single process's. So before the clip, the ranks of the first and last stages add their gradients of
it (one all-reduce over the pair), and the global norm counts it once: on the first stage, while the last stage's
copy is clipped by the same factor without being counted.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


class StageTies:
    """`parts`: this rank's stages (pipeline.split_stages marks their tied parameters); `mesh`: the world's, with a
    "pp" dimension."""

    def __init__(self, parts: list[nn.Module], mesh: DeviceMesh):
        held = [(part.stage, part.get_parameter(name)) for part in parts for name in getattr(part, "tied", [])]
        self.params = [p for _, p in held]
        self.copies = [p for stage, p in held if stage > 0]  # the last stage's: clipped, not counted in the norm
        # Whether the model ties is the same on every rank, also those of the stages between, which hold no tied
        # parameter but take part in making the groups.
        self.group = _end_pairs(mesh) if parts[0].ties else None
        self.device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
            else torch.device("cpu")

    def clip(self, clip: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        """`clip(uncounted=...)` (optim.clip_grad_norm_, its parameters bound) after the gradients are added."""
        def run() -> torch.Tensor:
            for p in self.params:
                if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    # TP's embedding leaves its gradient whole (Replicate) where the output projection's is split
                    # like the weight: both stages' local pieces must be the same piece.
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                if p.grad is not None:
                    local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    # Under CPU offload the gradient lives on the host, which NCCL cannot reduce.
                    on_device = local.to(self.device)
                    dist.all_reduce(on_device, group=self.group)
                    local.copy_(on_device)
            return clip(uncounted=self.copies)
        return run if self.group is not None else clip


def _end_pairs(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The group of this rank's pipeline's first and last ranks (None on the ranks between): the pp group itself
    when it is a pair; else one group per pipeline, each made by every rank in one order, as new groups must be."""
    if mesh["pp"].size() == 2:
        return mesh["pp"].get_group()
    mine = None
    for pair in pipeline_ends(mesh.mesh, mesh.mesh_dim_names.index("pp")):
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def pipeline_ends(ranks: torch.Tensor, pp_dim: int) -> list[list[int]]:
    """[first, last] rank of every pipeline of the world mesh `ranks` (its ranks laid out by dimension), whose
    dimension `pp_dim` is the pipeline's: stage 0 lives on its pp rank 0, the last stage on its last (looped
    placement, pipeline.py)."""
    return ranks.movedim(pp_dim, -1).reshape(-1, ranks.shape[pp_dim])[:, [0, -1]].tolist()
