"""Rotary position embeddings: the table of a model's positions, and its rotation of queries and keys.

Meta's layout: consecutive pairs (x[2i], x[2i+1]) of a head's dimensions rotate together. Hugging Face's models
rotate the first half against the second; each architecture's HF adapter permutes the rows of its query and key
projections (and of anything applied per head dimension before the rotation, as Qwen3's QK-norm) between the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Llama 3.1's long-context scaling, in Hugging Face's names (llama3/hf.py writes them into config.json).
ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class YaRN:
    """YaRN's long-context scaling, DeepSeek-V3's settings (Hugging Face's rope_scaling names in the comments): the
    low frequencies interpolated `factor` times, the high ones kept, a linear ramp between the dimensions that turn
    `beta_fast` and `beta_slow` times over the original context; attention's softmax scale times mscale(factor)^2.
    Applied where the model's context exceeds the original one, as DeepSeek's reference and torchtitan do."""
    factor: float = 40.0
    original_seq_len: int = 4096  # original_max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0  # mscale_all_dim (DeepSeek-V3 publishes mscale = mscale_all_dim, so cos and sin stay unscaled)

    def applies(self, max_seq_len: int) -> bool:
        return max_seq_len > self.original_seq_len

    def softmax_factor(self, max_seq_len: int) -> float:
        """What the softmax scale 1/sqrt(head dim) is multiplied by."""
        m = 0.1 * self.mscale * math.log(self.factor) + 1.0 if self.applies(max_seq_len) else 1.0
        return m * m

    def frequencies(self, powers: torch.Tensor, dim: int, base: float) -> torch.Tensor:
        """The rotation's frequencies from `powers`, base^(2i/dim): the high ones (1/powers) kept, the low ones
        divided by the factor, blended in between, in the YaRN paper's (and transformers') order of operations."""
        def turns(rotations: float) -> float:  # the dimension whose wavelength turns `rotations` times
            return dim * math.log(self.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(math.floor(turns(self.beta_fast)), 0), min(math.ceil(turns(self.beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=powers.device) - low) /
                (high - low if high > low else 0.001)).clamp(0, 1)
        kept = 1 - ramp  # the share of each frequency kept unscaled
        return 1.0 / (self.factor * powers) * (1 - kept) + 1.0 / powers * kept


def rope_table(args, device: torch.device | None = None) -> torch.Tensor:
    """(max_seq_len, rope_dim/2) table of cos + i·sin for rotary embeddings of `args` (rope_dim: the rotated part of
    a head, rope_theta, rope_scaling or yarn, max_seq_len), complex64: FSDP's mixed precision casts a block's
    floating-point inputs to the compute dtype, and a bf16 table would lose the positions' precision; complex tensors
    are left alone."""
    dim = args.rope_dim
    powers = args.rope_theta ** (torch.arange(0, dim, 2, device=device)[: dim // 2].float() / dim)
    freqs = 1.0 / powers
    if args.yarn is not None and args.yarn.applies(args.max_seq_len):
        freqs = args.yarn.frequencies(powers, dim, args.rope_theta)
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


def all_rows(rope: torch.Tensor, batch: int | None = None) -> torch.Tensor:
    return rope
