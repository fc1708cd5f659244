"""Sums across ranks in one fixed order, the canonical tree of training.layout_invariant: `tree_sum` defines it, and
FSDP's reduce-scatter follows it (`OrderedReduceScatter`), where gloo's own reduce-scatter sums in an order of its
algorithm and the rank count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


def tree_sum(values: list):
    """The canonical sum: adjacent pairs first, then pairs of those, an odd one carried up (None adds nothing)."""
    while len(values) > 1:
        values = [add(*values[i:i + 2]) if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
    return values[0]


def add(a, b):
    """a + b, where None is nothing to add (a parameter no micro-batch reached)."""
    return b if a is None else a if b is None else a + b


class OrderedReduceScatter(ReduceScatter):
    """FSDP's reduce-scatter, summed across the ranks in tree_sum's order (rank 0's piece first): an all-to-all
    brings each rank every rank's piece of its shard. Gloo's own reduce-scatter sums in an order of its algorithm and
    the rank count, so FSDP 4 and one process would differ in the last bit."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        if op != dist.ReduceOp.SUM:  # parallelize.py asks for plain sums
            raise ValueError(f"the ordered reduce-scatter sums; FSDP asked for {op}")
        pieces = torch.empty_like(input_tensor)
        dist.all_to_all_single(pieces, input_tensor, group=group)
        output_tensor.copy_(tree_sum(list(pieces.view(dist.get_world_size(group), -1))).view_as(output_tensor))
        return None
