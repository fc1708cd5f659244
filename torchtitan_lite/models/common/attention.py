"""Self-attention with grouped-query heads, optional QK-norm and a swappable attend.

Attention is the one thing the layouts and decoding change, so it is swappable and the rest of the forward exists
once. The module projects and rotates queries and keys itself (positions are the model's business), then hands them
to its `attend`, with k and v apart (their head sizes may differ): context parallelism swaps in its own through the
decoder's `attend_with` (parallel/context_parallel.Attend), and decoding passes a KV cache through the forward
(kv_cache.py), whose layer cache attends over the positions it holds. Projections reshape with -1 for the head count,
so the same code runs on the local heads of a tensor-parallel shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.models import documents as docs
from torchtitan_lite.models.common.layers import RMSNorm
from torchtitan_lite.models.common.rope import apply_rope


class Attention(nn.Module):
    """`args`: dim, n_heads, kv_heads, head_dim, norm_eps and qk_norm (an RMSNorm over each head's queries and keys
    before the rotation, Qwen3's; its weight is shared by the heads)."""

    def __init__(self, args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.attend = attend  # context parallelism swaps in its own (Decoder.attend_with)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache=None) -> torch.Tensor:
        """`rope`: the rotary rows of x's tokens (apply_rope). `mask`: None (causal) or the documents' mask
        (documents.py). `cache`: this layer's KV cache when decoding (generation.py), which attends in place of
        `attend`."""
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        out = self.attend(q, k, v, mask) if cache is None else cache.attend(q, k, v)
        return self.wo(out.reshape(bs, seq, -1))

    def init_weights(self, init, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init(linear.weight, 0.02)
        init(self.wo.weight, out_std)
        if self.q_norm is not None:
            self.q_norm.init_weights(init)
            self.k_norm.init_weights(init)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """Self-attention over whole sequences of rotated queries and keys, (bs, seq, heads, head_dim) in and out:
    causal, or under the documents' `mask` (an explicit mask for SDPA, or FlexAttention's)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if mask is not None and not isinstance(mask, torch.Tensor):
        return docs.flex_attend(q, k, v, mask).transpose(1, 2)
    # Grouped-query attention: each kv head serves several query heads, inside SDPA, without copies of K and V.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)
