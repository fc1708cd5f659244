"""The Llama 3 architecture and its flavors, single-device code: parallelism is applied from outside, by the plan
of parallelize.py in this folder.

Attention and FFN reshape with -1 for the head count, so the same code runs on the local heads of a tensor-parallel
shard. Layers live in a ModuleDict keyed "0".."n-1" so parameter names (and checkpoints) do not depend on wrapping.

Attention is the one thing the layouts and decoding change, so it is swappable and the rest of the forward exists
once. The model rotates queries and keys itself (positions are the model's business), then hands them to its
attention: context parallelism swaps in its own through `attend_with` (context_parallel.Attend, with the rotary rows
of the tokens a rank holds), and decoding passes a KV cache through the forward (generation.KVCache), whose layer
cache attends over the positions it holds.

Document masking (documents.py) enters as the forward's `documents`, the document id of every token of the window:
the forward turns them once into each token's rotary row and the mask every block attends under.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.models import documents as docs
from torchtitan_lite.models.init import canonical_name, trunc_normal_
from torchtitan_lite.models.moe import MoE, MoEArgs


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: as many as n_heads (no grouped-query attention)
    vocab_size: int = -1  # set from the tokenizer
    multiple_of: int = 256  # FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: bool = False  # Llama 3.1's long-context frequency scaling
    max_seq_len: int = 2048
    depth_init: bool = True  # output projections' std shrinks with depth (Llama recipe)
    moe: MoEArgs | None = None  # mixture-of-experts feed-forwards in the blocks it names (models/moe.py); None: dense

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def with_(self, **changes) -> ModelArgs:
        return replace(self, **changes)


FLAVORS: dict[str, ModelArgs] = {
    # The debug model's width in 2 blocks: the test suite's model (tests/assets/tiny.toml), whose time goes block by
    # block, and a smoke test of any layout with at most 2 pipeline stages.
    "tiny": ModelArgs(dim=256, n_layers=2, n_heads=16, rope_theta=500000),
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, rope_theta=500000),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
                    rope_theta=500000, rope_scaling=True),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
                     rope_theta=500000, rope_scaling=True),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096,
                      rope_theta=500000, rope_scaling=True),
    # Mixtral's architecture (8 routed experts, top-2 by softmax, renormalized, no shared expert, its auxiliary loss
    # at Mixtral's 0.02) at the debug model's width, and in 2 blocks for the suite; each expert as wide as the dense
    # model's feed-forward.
    "debugmodel_moe": ModelArgs(dim=256, n_layers=6, n_heads=16, rope_theta=500000, moe=MoEArgs(aux_loss_coeff=0.02)),
    "tiny_moe": ModelArgs(dim=256, n_layers=2, n_heads=16, rope_theta=500000, moe=MoEArgs(aux_loss_coeff=0.02)),
    # Mixtral 8x7B and 8x22B, their published shapes; the auxiliary loss at 8x7B's published 0.02.
    "mixtral_8x7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, rope_theta=1e6, max_seq_len=32768,
                              moe=MoEArgs(hidden=14336, aux_loss_coeff=0.02)),
    "mixtral_8x22b": ModelArgs(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, rope_theta=1e6, max_seq_len=65536,
                               moe=MoEArgs(hidden=16384, aux_loss_coeff=0.02)),
}


# Llama 3.1's long-context scaling, in Hugging Face's names (hf.py writes them into config.json).
ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def rope_table(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """(max_seq_len, head_dim/2) table of cos + i·sin for rotary embeddings, complex64: FSDP's mixed precision casts
    a block's floating-point inputs to the compute dtype, and a bf16 table would lose the positions' precision;
    complex tensors are left alone."""
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
    position (document masking)."""
    # Meta's layout: consecutive pairs (x[2i], x[2i+1]) rotate together. x: (bs, seq, heads, head_dim).
    # One complex multiplication (a kernel forward, one backward) instead of ~10 real element-wise ops and a stack,
    # which cost a share of the debug model's CPU step (benchmarks/model_step.py; docs/performance.md).
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rows = rope[: x.shape[1], None] if rope.dim() == 2 else rope[:, :, None]
    return torch.view_as_real(pairs * rows).flatten(-2).type_as(x)


def all_rows(rope: torch.Tensor) -> torch.Tensor:
    return rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def init_weights(self, init) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.attend = attend  # context parallelism swaps in its own (Transformer.attend_with)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache=None) -> torch.Tensor:
        """`rope`: the rotary rows of x's tokens (apply_rope). `mask`: None (causal) or the documents' mask
        (documents.py). `cache`: this layer's KV cache when decoding (generation.py), which attends in place of
        `attend`."""
        bs, seq, _ = x.shape
        q = apply_rope(self.wq(x).view(bs, seq, -1, self.head_dim), rope)
        k = apply_rope(self.wk(x).view(bs, seq, -1, self.head_dim), rope)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        out = self.attend(q, k, v, mask) if cache is None else cache.attend(q, k, v)
        return self.wo(out.reshape(bs, seq, -1))

    def init_weights(self, init, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init(linear.weight, 0.02)
        init(self.wo.weight, out_std)


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


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init, out_std: float) -> None:
        init(self.w1.weight, 0.02)
        init(self.w2.weight, out_std)
        init(self.w3.weight, out_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # A mixture-of-experts block holds `moe` where a dense one holds `feed_forward` (distinct parameter names),
        # and None for the other, as a pipeline stage does for what it does not hold (the TP plan names both).
        self.moe_enabled = args.moe is not None and args.moe.is_moe(layer_id)
        self.moe = self.feed_forward = None
        if self.moe_enabled:
            hidden = args.moe.hidden or args.ffn_hidden
            shared = FeedForward(args.dim, args.moe.shared_experts * hidden) if args.moe.shared_experts else None
            self.moe = MoE(args.dim, hidden, args.moe, shared)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_std = 0.02 / (2 * depth) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache=None) -> torch.Tensor:
        # The cache as a keyword: TP's PrepareModuleInput lays out the positional inputs alone.
        h = x + self.attention(self.attention_norm(x), rope, mask, cache=cache)
        return h + (self.moe if self.moe_enabled else self.feed_forward)(self.ffn_norm(h))

    def init_weights(self, init) -> None:
        self.attention_norm.init_weights(init)
        self.ffn_norm.init_weights(init)
        self.attention.init_weights(init, self.out_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(init, self.out_std)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        assert args.vocab_size > 0, "vocab_size comes from the tokenizer: ModelArgs.with_(vocab_size=...)"
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not persistent: derived from the args, recomputed by init_weights (to_empty leaves it garbage).
        self.register_buffer("rope", rope_table(args), persistent=False)
        # How a block_causal forward masks: documents.explicit_mask, or .block_mask (FlexAttention), chosen once at
        # start-up (train.py), like `attend`.
        self.document_mask = docs.explicit_mask
        # The rotary rows of the tokens this process holds, cut once per forward for every block (apply_rope keeps
        # them for backward): all of them, or a context-parallel rank's share (attend_with).
        self.held_rope = all_rows

    def forward(self, tokens: torch.Tensor, cache=None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `tokens`; with a KV cache (generation.KVCache), of the positions right after the cached ones.
        `documents` (block_causal): (bs, seq) document ids of the whole window (documents.document_ids), also where
        `tokens` is a context-parallel share of it or a pipeline stage's hidden states."""
        # A pipeline stage (pipeline.py) lacks the pieces other stages own: it takes and gives hidden states.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope, mask = self.rope, None
        if documents is not None:  # once per micro-batch, shared by every block
            rope, mask = self.rope[docs.positions(documents)], self.document_mask(documents, h.dtype)
        rope = self.held_rope(rope)
        if cache is not None:  # decoding: one process, eager, no wrappers; the rows from the first uncached position
            for name, layer in self.layers.items():
                h = layer(h, self.rope[cache.length:], cache=cache.layer(int(name)))
        else:  # training calls its wrapped blocks (checkpointed, compiled, sharded) with positional inputs alone
            for layer in self.layers.values():
                h = layer(h, rope, mask)
        return self.output(self.norm(h)) if self.output is not None else h

    def attend_with(self, attend, held_rows) -> None:
        """Context parallelism's seam (parallel/context_parallel.py): every block attends with `attend(q, k, v,
        mask)`, whose rotated queries, keys and values are those of the tokens this process holds, and the forward
        cuts those tokens' rotary rows with `held_rows`."""
        self.held_rope = held_rows
        for block in self.layers.values():
            block.attention.attend = attend

    @torch.no_grad()
    def init_buffers(self, device: torch.device | None = None) -> None:
        """Recomputes the rope table, which to_empty leaves garbage and no checkpoint holds, on `device` (default:
        where it is)."""
        self.rope = rope_table(self.args, device=device or self.rope.device)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter and recompute every buffer, identically on any mesh (see init.py). The buffers
        go to `buffer_device` when the parameters live elsewhere (on the host under CPU offload)."""
        self.init_buffers(buffer_device)
        names = {p: canonical_name(n) for n, p in self.named_parameters()}

        def init(param: torch.Tensor, std: float, cutoff: float = math.inf) -> None:
            # Default: untruncated. The Llama recipe's trunc_normal_ bounds (+-2 absolute) are >= 100 std here.
            trunc_normal_(param, std, cutoff, key=f"{seed}/{names[param]}")

        if self.tok_embeddings is not None:
            init(self.tok_embeddings.weight, 1.0)
        for layer in self.layers.values():
            layer.init_weights(init)
        if self.output is not None:
            self.norm.init_weights(init)
            init(self.output.weight, self.args.dim**-0.5, cutoff=3.0)


def count_params(model: nn.Module) -> tuple[int, int]:
    """(all parameters, the token-embedding table's) of the full model; works on meta tensors."""
    total = sum(p.numel() for p in model.parameters())
    return total, model.tok_embeddings.weight.numel()
