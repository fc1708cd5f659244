"""Context parallelism's order of sums on a layout without CP (training.layout_invariant_cp 2): one process computes
as CP 2's two ranks do, so that a layout with CP 2 and one without give the same bits.

CP 2 (headtail) gives rank r chunks r and 3 - r of every sequence's 4. Here the two ranks' token halves are stacked on
the batch dim, each leaf's rank-0 halves then its rank-1 halves (`stacker`, the loader's cut), and every module
computes on each half apart (tp_blocks.apply_blocks' token_blocks), with a cp rank's shapes: each sum over tokens (a
weight's gradient, a norm's, the embedding's, the loss) is then a cp rank's, and the halves are added as CP's
reduce-scatter adds them (one addition, in either order). Attention (`VirtualAttend`) computes each half's queries
against every key in one call, under the causal rows of their positions, as context_parallel.Attend does with
whole_rows; the keys' and values' gradients from the two halves' calls add as the gather's reduce-scatter adds them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchtitan_lite.config import JobConfig
from torchtitan_lite.parallel.context_parallel import (attend_rows, chunks, gather_order, in_order, shard,
                                                       whole_row_calls)

RANKS = 2  # CP 2's, headtail


def token_blocks(cfg: JobConfig, cp: int) -> int:
    """How many token halves each module computes on: 2 under layout_invariant_cp 2 on a layout without CP (a cp
    rank computes on its own tokens)."""
    return cfg.training.layout_invariant_cp if cfg.training.layout_invariant and cp == 1 else 1


def halves(seq_len: int) -> list[list[tuple[int, int]]]:
    """Each virtual rank's [start, stop) ranges of a sequence."""
    return [chunks(seq_len, RANKS, r, "headtail") for r in range(RANKS)]


def stacker(seq_len: int, leaf: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the loader applies to inputs and labels: (B, seq) -> (2B, seq/2), each `leaf` sequences' (a micro-batch's;
    a pipeline's micro-batch) rank-0 halves then their rank-1 halves, so a pipeline's cut of the batch keeps them."""
    ranks = halves(seq_len)

    def stack(x: torch.Tensor) -> torch.Tensor:
        groups = x.unflatten(0, (-1, leaf)) if x.shape[0] % leaf == 0 else x[None]
        return torch.cat([shard(groups, ranges, dim=2) for ranges in ranks], 1).flatten(0, 1)
    return stack


def stacked(cfg: JobConfig, cp: int, leaf: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The loader's cut on a layout without CP: `stacker` under layout_invariant_cp 2, else none."""
    return stacker(cfg.training.seq_len, leaf) if token_blocks(cfg, cp) > 1 else None


class VirtualAttend:
    """context_parallel.Attend(whole_rows=True) of both cp ranks at once, on their stacked halves: the gather is the
    stack itself."""

    def __init__(self, seq_len: int):
        self.ranks = halves(seq_len)
        self.order = gather_order(seq_len, RANKS, "headtail")
        self.calls = [whole_row_calls(ranges, seq_len) for ranges in self.ranks]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        kv = in_order(torch.cat([k, v], dim=-1).chunk(RANKS), self.order)  # what each rank's all-gather gives
        return torch.cat([attend_rows(q_r, kv, k.shape[-1], calls, mask)
                          for q_r, calls in zip(q.chunk(RANKS), self.calls)])

    def rows(self, rope: torch.Tensor, batch: int) -> torch.Tensor:
        """Each stacked sequence's rotary rows, (batch, seq/2, head_dim/2): its rank's positions."""
        return torch.cat([shard(rope, ranges, dim=0).expand(batch // RANKS, -1, -1) for ranges in self.ranks])


def apply_cp_blocks(model: nn.Module, seq_len: int) -> None:
    """The attention of CP 2's ranks on one process (the modules' token halves: tp_blocks.apply_blocks)."""
    attend = VirtualAttend(seq_len)
    model.attend_with(attend, attend.rows)
