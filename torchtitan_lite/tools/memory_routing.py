"""A mixture of experts as the memory estimate (memory.py) traces it: fake tensors hold no routing, so the routing a
step is traced with is chosen here, and the few places that read routing on the host are given that choice's numbers.

"balanced": every expert gets an equal share of each sequence's slots (the balance load balancing aims at), so each
expert-parallel rank sends and receives its own slot count. "worst": the bound on what the traced rank can receive,
every rank's tokens sent to its experts. Dropless, a token sends min(top_k, local experts) slots to them: ep x T x
min(k, E/ep) slots for a rank's T x k (4x balanced for Mixtral's 8 experts, top 2, on EP 8). With a capacity factor
(models/common/capacity.py) an expert takes at most C slots of each sequence, and a rank's part of a sequence holds at
most `s` of its tokens, so each source rank sends the traced rank's E/ep experts at most b x E/ep x min(C, s) slots of
its b sequences, and keeps at most b x E x min(C, s) of its own: with a factor of 1 that is no more than balanced
routing's (capacity exactly fills at balance). The bound is per source rank: where one sequence spans several ep
ranks (context or sequence parallelism), its C slots cannot all come from each of them, so it is above what any
routing reaches there. Without expert parallelism a rank computes its own kept slots whatever the routing, as many
as the capacity allows. No other op's memory depends on the routing. The grouped GEMM runs as one matmul of the same
output, saving the same operands: a fake grouped_mm takes bf16 alone, and the per-expert loop reads the counts.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from torchtitan_lite.models.common import capacity, moe
from torchtitan_lite.parallel import expert_parallel


@contextlib.contextmanager
def routed(routing: str, args: moe.MoEArgs | None, seq_len: int):
    """Within it, a mixture of experts of `args` (None: the model has none) runs on fake tensors as `routing` says:
    "balanced" or "worst" (the module docstring), on sequences of `seq_len` tokens."""
    k = args.top_k if args else 1
    limit = capacity.capacity(args.capacity_factor, seq_len, k, args.num_experts) if args and args.capacity_factor \
        else None
    held = {}  # the last capacity call's sequences and tokens a sequence, on this rank

    def kept_count(keep: torch.Tensor) -> int:
        b, s, _ = held["shape"] = keep.shape
        per_expert = min(limit, s) if routing == "worst" else limit * s // seq_len  # balanced: its share of C
        return min(b * s * k, b * args.num_experts * per_expert)

    def split(counts: torch.Tensor, received: torch.Tensor, slots: int) -> tuple[list[int], list[int]]:
        n, local = received.shape
        sent = [slots // n + (i < slots % n) for i in range(n)]
        if routing != "worst":
            return sent, sent
        if limit is None:
            return sent, [slots // k * min(k, local)] * n
        b, s, _ = held["shape"]
        return sent, [min(b * s * min(k, local), b * local * min(limit, s))] * n

    with mock.patch.object(moe, "grouped_mm_fits", lambda x, w: True), \
            mock.patch.object(moe, "grouped", lambda x, w, counts: x @ w[0].transpose(-2, -1)), \
            mock.patch.object(expert_parallel, "split_sizes", split), \
            mock.patch.object(capacity, "kept_count", kept_count):
        yield
