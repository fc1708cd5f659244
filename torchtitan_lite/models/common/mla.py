"""Multi-head latent attention (MLA: DeepSeek-V2 and V3, Kimi K2): keys and values come from one low-rank latent of
each token, the queries from another (or straight from the hidden states), and each head's query and key are a part
that is rotated and a part that is not.

Per token: the latent c_kv = kv_norm(wkv_a(x)[:kv_rank]) expands (wkv_b) into every head's unrotated key and its
value; the rotated part of the key, wkv_a(x)[kv_rank:], is one for all heads. The query is wq(x), or
wq_b(q_norm(wq_a(x))) with a query latent. So a key is rope_dim + nope_dim wide and a value v_dim, and the attend
gets k and v of different head sizes (context parallelism's and the KV cache's split them by their own). YaRN's
softmax factor (rope.YaRN) multiplies the queries, which gives the attend's own 1/sqrt(head size) its value.

Single-device code like the decoder's attention (attention.py), whose `attend` seam it keeps; projections reshape
with -1 for the head count, so the same code runs on a tensor-parallel rank's heads.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_lite.models.common.attention import attend
from torchtitan_lite.models.common.layers import RMSNorm
from torchtitan_lite.models.common.rope import apply_rope


class MLA(nn.Module):
    """`args`: dim, n_heads, q_rank (0: no query latent), kv_rank, nope_dim, rope_dim, v_dim, norm_eps, and the
    softmax factor of its context (yarn)."""

    def __init__(self, args):
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = args.nope_dim, args.rope_dim, args.v_dim, args.kv_rank
        qk_dim = args.nope_dim + args.rope_dim
        latent = args.q_rank > 0
        self.wq = None if latent else nn.Linear(args.dim, args.n_heads * qk_dim, bias=False)
        self.wq_a = nn.Linear(args.dim, args.q_rank, bias=False) if latent else None
        self.q_norm = RMSNorm(args.q_rank, args.norm_eps) if latent else None
        self.wq_b = nn.Linear(args.q_rank, args.n_heads * qk_dim, bias=False) if latent else None
        self.wkv_a = nn.Linear(args.dim, args.kv_rank + args.rope_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_rank, args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_rank, args.n_heads * (args.nope_dim + args.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_dim, args.dim, bias=False)
        # Where the rotated key part, one for all heads, meets the heads' split: nothing on one device; under TP the
        # plan's seam (common/parallelize.mla_tp_plan), since every rank holds it whole and uses it for its heads.
        self.shared_key = nn.Identity()
        self.softmax_factor = 1.0 if args.yarn is None else args.yarn.softmax_factor(args.max_seq_len)
        self.attend = attend  # context parallelism swaps in its own (Decoder.attend_with)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache=None) -> torch.Tensor:
        """As attention.Attention's: `rope` the rotary rows of x's tokens, `mask` None (causal) or the documents',
        `cache` this layer's KV cache when decoding."""
        bs, seq, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(bs, seq, -1, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], -1)
        kv, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], -1)
        k_rope = apply_rope(self.shared_key(k_rope).unsqueeze(2), rope)  # one rotated key part, every head's
        k_nope, v = self.wkv_b(self.kv_norm(kv)).view(bs, seq, -1, self.nope_dim + self.v_dim).split(
            [self.nope_dim, self.v_dim], -1)
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], -1)
        if self.softmax_factor != 1.0:
            q = q * self.softmax_factor
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], -1)
        out = self.attend(q, k, v, mask) if cache is None else cache.attend(q, k, v)
        return self.wo(out.reshape(bs, seq, -1))

    def init_weights(self, init, out_std: float) -> None:
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                init(linear.weight, 0.02)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.init_weights(init)
        init(self.wo.weight, out_std)
