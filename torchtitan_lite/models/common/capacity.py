"""An optional expert capacity (`moe.capacity_factor`, Megatron's moe_expert_capacity_factor): each routed expert
takes at most C = ceil(seq_len x top_k / num_experts x capacity_factor) slots of each sequence, and a slot past that
is dropped: its expert never computes it, and it adds nothing to its token's output (no renormalization of the
token's other weights, as Megatron); the shared experts and the residual still apply. 0, the default, is dropless.

Per sequence, not per rank's batch (Megatron's C counts the tokens a rank routes): a rank's batch is whatever the
layout cut, so a per-rank capacity would drop other slots on FSDP than on one process, and under context or sequence
parallelism (a rank holds part of each sequence) other slots again. A sequence is the same on every layout, so its
capacity and its drops are too, and a run keeps the parity promise with a capacity on.

Which slots: an expert keeps the first C of a sequence's slots in position order and drops the rest (Megatron's
"position" drop policy). No order among a token's k choices is needed: they are k distinct experts, so a token has at
most one slot at each expert, and an expert's slots are ordered by position alone. Position order is also causal:
whether a token's slot is kept depends on it and the tokens before it, never on later ones, which the language model
must not see. Under a document mask (block_causal) the sequence is the packed window, as the data loader cut it.

Where a sequence is split across ranks, a rank counts its own slots and adds, for each of its tokens, the slots the
other ranks hold at earlier positions (parallel/sequence_slots.py, set from outside as `elsewhere`).
"""

from __future__ import annotations

import math

import torch

from torchtitan_lite.config import ConfigError


def capacity(factor: float, seq_len: int, top_k: int, num_experts: int) -> int:
    """Slots an expert takes of a sequence of `seq_len` tokens: Megatron's get_capacity, ceil(tokens x k / E x
    factor), with a sequence's tokens for its tokens."""
    return math.ceil(seq_len * top_k / num_experts * factor)


def check(args, seq_len: int) -> None:
    """ConfigError where the factor gives an expert less than one slot of a sequence before the ceiling: rounded up to
    one, the run would train with a larger factor than the config says, so it is refused instead."""
    exact = seq_len * args.top_k / args.num_experts * args.capacity_factor
    if 0 < exact < 1:
        lowest = args.num_experts / (seq_len * args.top_k)
        raise ConfigError(f"moe.capacity_factor {args.capacity_factor:g} gives each expert {exact:.3g} slots of a "
                          f"{seq_len}-token sequence (x {args.top_k} / {args.num_experts} experts), less than one: "
                          f"use at least {lowest:.4g}, or 0 for dropless routing")


def kept(experts: torch.Tensor, num_experts: int, capacity: int, elsewhere=None) -> torch.Tensor:
    """Which slots their experts take: `experts` (sequences, tokens, k), the tokens in position order; a bool of its
    shape. `elsewhere`, where other ranks hold the rest of each sequence: (sequences, tokens, experts) int32 slots at
    each expert -> the slots at that expert at earlier positions that the other ranks hold, same shape."""
    hits = torch.zeros(*experts.shape[:2], num_experts, dtype=torch.int32, device=experts.device)
    hits.scatter_(-1, experts, 1)  # a token's k experts are distinct: 0 or 1 slot at each
    before = hits.cumsum(1, dtype=torch.int32) - hits
    if elsewhere is not None:
        before = before + elsewhere(hits)
    return before.gather(-1, experts) < capacity


def kept_count(keep: torch.Tensor) -> int:
    """The slots kept, `keep` (sequences, tokens, k): read on the host, since the experts' input holds that many rows
    (one device sync; the memory estimate, whose fake tensors hold no routing, puts its bound here)."""
    return int(keep.sum())
