"""The Qwen3 architecture: its args and flavors, dense and mixtures of experts. The model is the shared decoder
(models/common/decoder.py) on these args, with what Qwen3 chose: QK-norm, a head size of its own (not dim / heads),
the output projection tied to the embedding table in the small sizes, rope theta 1e6, and for the mixtures 128
fine-grained experts, top 8 by softmax, renormalized (norm_topk_prob), with the Switch auxiliary loss at 0.001.
The published shapes are the config.json files of Qwen's Hugging Face folders (Qwen/Qwen3-0.6B ... Qwen3-235B-A22B).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchtitan_lite.models.common.attention import Attention
from torchtitan_lite.models.common.moe import MoEArgs


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int = 128  # Qwen3's own: 128 at every size, whatever dim / n_heads is
    ffn_hidden: int = 3072  # a dense block's feed-forward hidden size (intermediate_size)
    vocab_size: int = -1  # set from the tokenizer
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_embeddings: bool = False  # the output projection is the embedding table (0.6B, 1.7B, 4B)
    depth_init: bool = True  # output projections' std shrinks with depth (torchtitan's recipe for Qwen3 too)
    moe: MoEArgs | None = None  # every block a mixture of experts (Qwen3-MoE); None: dense
    # The decoder's choices Qwen3 makes at every size (class attributes, not fields: no flavor changes them).
    qk_norm = True
    rope_scaling = False
    yarn = None
    attention = Attention

    @property
    def rope_dim(self) -> int:  # a head's dimensions the rotation turns: all of them
        return self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def with_(self, **changes) -> ModelArgs:
        return replace(self, **changes)


def qwen3_moe(hidden: int) -> MoEArgs:
    """Qwen3-MoE's mixture: 128 routed experts of `hidden` each, top 8 by softmax, renormalized, no shared expert,
    the Switch auxiliary loss at the published router_aux_loss_coef."""
    return MoEArgs(num_experts=128, top_k=8, hidden=hidden, score_func="softmax", renormalize=True,
                   aux_loss_coeff=0.001)


FLAVORS: dict[str, ModelArgs] = {
    # For the CPU and the suite: 2 blocks at the Llama debug model's width, a head size that is not dim / n_heads,
    # grouped-query attention, tied embeddings as the small published sizes; and its mixture, 16 experts of 128,
    # top 4 (fine-grained, as Qwen3-MoE's), Qwen3-MoE's routing and auxiliary loss.
    "debugmodel": ModelArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=64, ffn_hidden=768,
                            tie_embeddings=True),
    "debugmodel_moe": ModelArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=64, ffn_hidden=768,
                                moe=replace(qwen3_moe(128), num_experts=16, top_k=4)),
    # The published dense sizes.
    "0.6B": ModelArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden=3072, tie_embeddings=True),
    "1.7B": ModelArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden=6144, tie_embeddings=True),
    "4B": ModelArgs(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden=9728, tie_embeddings=True),
    "8B": ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden=12288),
    "14B": ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden=17408),
    "32B": ModelArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden=25600),
    # The published mixtures (intermediate_size, their dense width, is used by no block).
    "30B-A3B": ModelArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden=6144, moe=qwen3_moe(768)),
    "235B-A22B": ModelArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_hidden=12288, moe=qwen3_moe(1536)),
}
