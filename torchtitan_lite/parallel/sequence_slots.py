"""Where each rank holds part of every sequence (context parallelism, TP's sequence parallelism), the slots of a
sequence at earlier positions that the other ranks hold: what an expert capacity needs to drop the same slots as one
process does (models/common/capacity.py: an expert keeps a sequence's first C slots in position order).

A rank's tokens are a few contiguous ranges of the sequence ("pieces"): context parallelism's chunks (one, or two
with the head-tail balancer, which are not adjacent), then sequence parallelism's t-th contiguous part of what the
cp rank holds, which may cut a chunk or span two. So per MoE layer and micro-batch the ranks all-gather, over the
sequence mesh (ParallelDims.sequence_mesh), each piece's start and its slots per (sequence, expert): a few integers a
piece, and a rank adds to each of its tokens' counts those of the other ranks' pieces that start before the token's
piece. Its own earlier pieces are already in its own running count, since a rank holds its pieces in position order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_lite.parallel.context_parallel import chunks


def held_ranges(seq_len: int, cp: int, cp_rank: int, tp: int, tp_rank: int, balancer: str) -> list[tuple[int, int]]:
    """The [start, stop) ranges of a sequence that a rank holds, in the order it holds them: the cp rank's chunks
    (context_parallel.chunks) joined, and of those the tp rank's contiguous part (sequence parallelism's Shard(1),
    torch.chunk's sizes)."""
    cut = chunks(seq_len, cp, cp_rank, balancer) if cp > 1 else [(0, seq_len)]
    held = sum(stop - start for start, stop in cut)
    part = -(-held // tp)
    low, high, offset, ranges = tp_rank * part, min(held, (tp_rank + 1) * part), 0, []
    for start, stop in cut:
        first, last = max(low, offset), min(high, offset + stop - start)  # this chunk's overlap, in held order
        if first < last:
            ranges.append((start + first - offset, start + last - offset))
        offset += stop - start
    return ranges


class EarlierSlots:
    """capacity.kept's `elsewhere` for one rank of the ranks that hold parts of each `seq_len`-token sequence: `held`,
    this rank's ranges (held_ranges), sent as `pieces` of them (every rank sends as many); `rank`, its place in
    `gather`'s order. `gather`: a (pieces, n) int64 tensor -> every rank's, (ranks x pieces, n), in rank order; an
    all-gather over the sequence group (of_mesh), or a stand-in in the tests."""

    def __init__(self, seq_len: int, held: list[tuple[int, int]], pieces: int, rank: int, gather):
        self.seq_len, self.pieces, self.rank, self.gather = seq_len, pieces, rank, gather
        own = held + [(seq_len, seq_len)] * (pieces - len(held))  # an empty piece, at the end: it precedes nothing
        self.starts = [start for start, _ in own]
        self.piece_of_token = torch.cat([torch.full((stop - start,), i) for i, (start, stop) in enumerate(own)])

    @classmethod
    def of_mesh(cls, mesh: DeviceMesh, group: dist.ProcessGroup, seq_len: int, balancer: str) -> EarlierSlots:
        """This rank's, on the trainer's `mesh` (its "cp" and "tp" dims), gathering over `group`, the sequence mesh's:
        each rank's pieces travel with their starts, so the group's rank order needs no assumption."""
        cp, tp = mesh["cp"].size(), mesh["tp"].size()
        pieces = max(len(held_ranges(seq_len, cp, c, tp, t, balancer)) for c in range(cp) for t in range(tp))
        held = held_ranges(seq_len, cp, mesh["cp"].get_local_rank(), tp, mesh["tp"].get_local_rank(), balancer)
        size = dist.get_world_size(group)

        def gather(rows: torch.Tensor) -> torch.Tensor:  # a list all-gather: torch 2.13 deprecates the tensor ones
            parts = [torch.empty_like(rows) for _ in range(size)]
            dist.all_gather(parts, rows, group=group)
            return torch.cat(parts)

        return cls(seq_len, held, pieces, dist.get_rank(group), gather)

    def __call__(self, hits: torch.Tensor) -> torch.Tensor:
        """`hits` (sequences, tokens, experts): this rank's tokens' slots at each expert, in held order -> for each,
        the slots at that expert at earlier positions of its sequence that the other ranks hold."""
        sequences, tokens, experts = hits.shape
        piece = self.piece_of_token.to(hits.device)
        assert tokens == piece.numel(), f"{tokens} tokens of a sequence here, where the layout puts {piece.numel()}"
        counts = hits.new_zeros(self.pieces, sequences, experts).index_add_(0, piece, hits.transpose(0, 1))
        starts = torch.tensor(self.starts, device=hits.device)
        every = self.gather(torch.cat([starts[:, None], counts.flatten(1).long()], dim=1))
        theirs = torch.ones(every.shape[0], dtype=torch.bool, device=hits.device)
        theirs[self.rank * self.pieces:(self.rank + 1) * self.pieces] = False
        before = (every[:, 0][None, :] < starts[:, None]) & theirs  # (own pieces, every piece)
        counted = every[:, 1:].view(-1, sequences, experts)
        earlier = (before[:, :, None, None] * counted).sum(1).to(hits.dtype)  # (own pieces, sequences, experts)
        return earlier[piece].transpose(0, 1)
