"""The Llama 3 architecture: its args and flavors. The model is the shared decoder (models/common/decoder.py) on
these args; parallelism is applied from outside, by the plan of parallelize.py in this folder.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchtitan_lite.models.common.decoder import Decoder
from torchtitan_lite.models.common.attention import Attention
from torchtitan_lite.models.common.moe import MoEArgs


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
    moe: MoEArgs | None = None  # mixture-of-experts feed-forwards in the blocks it names; None: dense
    # What Llama does not have of the decoder's choices (class attributes, not fields: no flavor sets them).
    qk_norm = False
    tie_embeddings = False
    yarn = None
    attention = Attention

    @property
    def rope_dim(self) -> int:  # a head's dimensions the rotation turns: all of them
        return self.head_dim

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


Transformer = Decoder  # Llama 3 is the shared decoder on ModelArgs
