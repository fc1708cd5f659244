"""The decoder every architecture here is: token embedding, blocks of attention and a feed-forward (dense or a
mixture of experts) around pre-norms, a final norm and the output projection. Single-device code: parallelism is
applied from outside, each architecture's TP plan naming these modules.

What differs between architectures is in their args, which hold at least DecoderArgs' fields: sizes, QK-norm, tied
embeddings, the rotary table's settings, where the mixture of experts goes. Blocks live in a ModuleDict keyed
"0".."n-1" so parameter names (and checkpoints) do not depend on wrapping.

Document masking (documents.py) enters as the forward's `documents`, the document id of every token of the window:
the forward turns them once into each token's rotary row and the mask every block attends under.

Tied embeddings (`tie_embeddings`: the output projection is the embedding table, as Qwen3's small sizes publish it)
are one Parameter under two names. Whoever replaces parameters (TP, to_empty) calls `tie_weights()` after; a pipeline
stage holds it under the one name its modules keep, and the pipeline sums the first and last stages' gradients of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from torchtitan_lite.config import ConfigError
from torchtitan_lite.models import documents as docs
from torchtitan_lite.models.common.block import TransformerBlock
from torchtitan_lite.models.common.kv_cache import KVCache
from torchtitan_lite.models.common.layers import RMSNorm
from torchtitan_lite.models.common.moe import MoEArgs, configured, inactive_params
from torchtitan_lite.models.common.mtp import MTPBlock
from torchtitan_lite.models.common.parallelize import tp_plan, tp_sizes
from torchtitan_lite.models.common.rope import YaRN, all_rows, rope_table
from torchtitan_lite.models.init import canonical_name, trunc_normal_
from torchtitan_lite.models.spec import HFAdapter, ModelSpec
from torchtitan_lite.runtime import metrics


class DecoderArgs(Protocol):
    dim: int
    n_layers: int
    n_heads: int
    kv_heads: int  # grouped-query attention's key/value heads
    head_dim: int
    ffn_hidden: int  # a dense block's feed-forward hidden size
    vocab_size: int  # set from the tokenizer
    max_seq_len: int  # the rotary table's rows
    norm_eps: float
    rope_theta: float
    rope_scaling: bool  # Llama 3.1's long-context frequency scaling (rope.py)
    qk_norm: bool  # RMSNorm of each head's queries and keys before the rotation (Qwen3)
    tie_embeddings: bool  # the output projection is the embedding table
    depth_init: bool  # output projections' std shrinks with the block's depth (Llama recipe), else with n_layers
    moe: MoEArgs | None  # mixture-of-experts feed-forwards in the blocks it names (moe.py); None: dense
    attention: type  # a block's attention, built from the args: Attention (attention.py) or MLA (mla.py)
    rope_dim: int  # a head's dimensions the rotation turns (MLA: its rotated part)
    yarn: YaRN | None  # YaRN's long-context scaling (DeepSeek-V3); None: none
    mtp_depth: int  # multi-token prediction's modules after the blocks (mtp.py); 0, or absent: none


class Decoder(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        assert args.vocab_size > 0, "vocab_size comes from the tokenizer: ModelArgs.with_(vocab_size=...)"
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        # Multi-token prediction's modules, depth k's keyed k - 1 (mtp.py); None without, as a pipeline stage holds
        # what other stages hold.
        depth = getattr(args, "mtp_depth", 0)
        self.mtp = nn.ModuleDict({str(k): MTPBlock(args.n_layers + k, args) for k in range(depth)}) if depth else None
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # Not persistent: derived from the args, recomputed by init_weights (to_empty leaves it garbage).
        self.register_buffer("rope", rope_table(args), persistent=False)
        # How a block_causal forward masks: documents.explicit_mask, or .block_mask (FlexAttention), chosen once at
        # start-up (train.py), like `attend`.
        self.document_mask = docs.explicit_mask
        # The rotary rows of the tokens this process holds, cut once per forward for every block (apply_rope keeps
        # them for backward): all of them, or a context-parallel rank's share (attend_with).
        self.held_rope = all_rows

    def tie_weights(self) -> None:
        """With tied embeddings, makes the output projection's weight the embedding table's Parameter again (where
        this module holds both)."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device, recurse: bool = True) -> Decoder:
        """nn.Module's, which gives each module a tensor of its own: tied embeddings are tied again after."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def forward(self, tokens: torch.Tensor, cache=None, documents: torch.Tensor | None = None,
                mtp_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `tokens`; with a KV cache (kv_cache.py), of the positions right after the cached ones.
        `documents` (block_causal): (bs, seq) document ids of the whole window (documents.document_ids), also where
        `tokens` is a context-parallel share of it or a pipeline stage's hidden states. `mtp_tokens` (training with
        multi-token prediction): (bs, seq, D), column k - 1 the tokens depth k embeds at each position (mtp.py);
        the logits of depth k follow the main model's on the batch dim, (1 + D) x bs rows in all."""
        # A pipeline stage (pipeline.py) lacks the pieces other stages own: it takes hidden states (floating point,
        # where token ids are integers; the last stage may hold a tied embedding table it does not use) and gives them.
        h = tokens if tokens.is_floating_point() else self.tok_embeddings(tokens)
        rope, mask = self.rope, None
        if documents is not None:  # once per micro-batch, shared by every block
            rope, mask = self.rope[docs.positions(documents)], self.document_mask(documents, h.dtype)
        rope = self.held_rope(rope, h.shape[0])
        if cache is not None:  # decoding: one process, eager, no wrappers; the rows from the first uncached position
            for name, layer in self.layers.items():
                h = layer(h, self.rope[cache.length:], cache=cache.layer(int(name)))
        else:  # training calls its wrapped blocks (checkpointed, compiled, sharded) with positional inputs alone
            for layer in self.layers.values():
                h = layer(h, rope, mask)
        if self.output is None:
            return h
        out = self.norm(h)
        if mtp_tokens is not None:  # each depth's from the one before, beside the main model's: one projection
            outs = [out]
            for k, block in enumerate(self.mtp.values()):
                outs.append(block(outs[-1], rope, mask, self.tok_embeddings(mtp_tokens[..., k])))
            out = torch.cat(outs)
        return self.output(out)

    def blocks(self) -> list[nn.Module]:
        """Every block held, the MTP modules after the main ones: what parallelism wraps block by block."""
        return [*self.layers.values(), *(self.mtp.values() if getattr(self, "mtp", None) is not None else ())]

    def kv_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for decoding `batch` sequences of up to `max_len` positions (tools/generation.py)."""
        return KVCache(self, batch, max_len)

    def attend_with(self, attend, held_rows) -> None:
        """Context parallelism's seam (parallel/context_parallel.py): every block attends with `attend(q, k, v,
        mask)`, whose rotated queries, keys and values are those of the tokens this process holds, and the forward
        cuts those tokens' rotary rows with `held_rows(rope, batch)` (`batch`: the forward's sequences)."""
        self.held_rope = held_rows
        for block in self.blocks():
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

        def init(param: torch.Tensor, std: float, cutoff: float = math.inf, name: str | None = None) -> None:
            # Default: untruncated. The Llama recipe's trunc_normal_ bounds (+-2 absolute) are >= 100 std here.
            trunc_normal_(param, std, cutoff, key=f"{seed}/{name or names[param]}")

        # A tied table is the output projection's, initialized as it is under its name on every stage that holds it.
        tied = self.args.tie_embeddings
        if self.tok_embeddings is not None:
            if tied:
                init(self.tok_embeddings.weight, self.args.dim**-0.5, cutoff=3.0, name="output.weight")
            else:
                init(self.tok_embeddings.weight, 1.0)
        for layer in self.blocks():
            layer.init_weights(init)
        if self.output is not None:
            self.norm.init_weights(init)
            if not (tied and self.tok_embeddings is not None):
                init(self.output.weight, self.args.dim**-0.5, cutoff=3.0, name="output.weight")


def count_params(model: nn.Module) -> tuple[int, int]:
    """(all parameters, the token-embedding table's) of the full model; works on meta tensors."""
    total = sum(p.numel() for p in model.parameters())
    return total, model.tok_embeddings.weight.numel()


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs of a token of the whole model (on meta will do) at `seq_len`: the dense formula of
    runtime/metrics.py over the parameters a token uses outside the embedding lookup (of the routed experts, its
    top k; a tied table counts once, as the output projection's matmul), and the attention's S x S scores."""
    n_params, n_embedding = count_params(model)
    a = model.args
    lookup = 0 if a.tie_embeddings else n_embedding
    return metrics.flops_per_token(n_params - inactive_params(model), a.n_layers, a.n_heads, a.head_dim, seq_len,
                                   lookup)


def param_group(name: str) -> str:
    """What an optimizer needs to know of the decoder's parameter `name` (its full-model name): "embedding" (the table
    and the output projection, tied or not), "norm", "router" (a mixture's gate), "bias" (the decoder has none), or
    "matrix": every hidden projection, and each routed expert's slice of a 3-D weight."""
    if name in ("tok_embeddings.weight", "output.weight"):
        return "embedding"
    if name.endswith("norm.weight"):
        return "norm"
    if ".router." in name:
        return "router"
    return "bias" if name.endswith(".bias") else "matrix"


def configure(args, cfg):
    """The config's [moe] settings over the flavor's mixture (moe.configured), and model.mtp_depth where set: the
    decoder's configure."""
    args = args.with_(moe=configured(args.moe, cfg.moe, cfg.model.flavor))
    if cfg.model.mtp_depth is None:
        return args
    if not hasattr(args, "mtp_depth"):
        raise ConfigError(f"model.mtp_depth is set but model {cfg.model.name} has no multi-token prediction modules "
                          "(DeepSeek-V3's): remove it")
    return args.with_(mtp_depth=cfg.model.mtp_depth)


def decoder_spec(name: str, flavors: Mapping[str, Any], hf: HFAdapter | None,
                 published_vocab: Mapping[str, int], bitwise_layouts: bool = False) -> ModelSpec:
    """The spec of an architecture that is this decoder on args of its own (Llama 3, Qwen3): the decoder's class, TP
    plan, FLOP count, parameter groups and [moe] settings, with the architecture's flavors, Hugging Face adapter and
    published vocabularies. Every block the same module on the same shapes (only its initialization depends on its
    index: depth_init), so the memory estimate may extrapolate from a few."""
    return ModelSpec(name=name, model_class=Decoder, flavors=flavors, tp_plan=tp_plan, tp_sizes=tp_sizes,
                     flops_per_token=flops_per_token, param_group=param_group, configure=configure, hf=hf,
                     blocks_alike=True, published_vocab=published_vocab, bitwise_layouts=bitwise_layouts)
