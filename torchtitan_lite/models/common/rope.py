"""Rotary position embeddings: the table of a model's positions, and its rotation of queries and keys.

Meta's layout: consecutive pairs (x[2i], x[2i+1]) of a head's dimensions rotate together. Hugging Face's models
rotate the first half against the second; each architecture's HF adapter permutes the rows of its query and key
projections (and of anything applied per head dimension before the rotation, as Qwen3's QK-norm) between the two.
"""

from __future__ import annotations

import math

import torch

# Llama 3.1's long-context scaling, in Hugging Face's names (llama3/hf.py writes them into config.json).
ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def rope_table(args, device: torch.device | None = None) -> torch.Tensor:
    """(max_seq_len, head_dim/2) table of cos + i·sin for rotary embeddings of `args` (head_dim, rope_theta,
    rope_scaling, max_seq_len), complex64: FSDP's mixed precision casts a block's floating-point inputs to the compute
    dtype, and a bf16 table would lose the positions' precision; complex tensors are left alone."""
    dim = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, device=device)[: dim // 2].float() / dim))
    if args.rope_scaling:  # Llama 3.1: stretch low frequencies 8x, keep high ones, blend in between
        scale, low_ff, high_ff, old_ctx = ROPE_SCALING.values()
        wavelen = 2 * math.pi / freqs
        smooth = ((old_ctx / wavelen) - low_ff) / (high_ff - low_ff)
        blended = (1 - smooth) * freqs / scale + smooth * freqs
        freqs = torch.where(wavelen > old_ctx / low_ff, freqs / scale,
                            torch.where(wavelen < old_ctx / high_ff, freqs, blended))
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.complex(angles.cos(), angles.sin())


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """`rope`: the table, whose first rows are positions 0..seq-1, or (bs, seq, head_dim/2) rows of each token's own
    position (document masking). x: (bs, seq, heads, head_dim)."""
    # One complex multiplication (a kernel forward, one backward) instead of ~10 real element-wise ops and a stack,
    # which cost a share of the debug model's CPU step (benchmarks/model_step.py; docs/performance.md).
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rows = rope[: x.shape[1], None] if rope.dim() == 2 else rope[:, :, None]
    return torch.view_as_real(pairs * rows).flatten(-2).type_as(x)


def all_rows(rope: torch.Tensor) -> torch.Tensor:
    return rope
