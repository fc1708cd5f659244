"""The DeepSeek-V3 architecture: its args and flavors. The model is the shared decoder (models/common/decoder.py) on
these args, with DeepSeek's choices: multi-head latent attention (common/mla.py) whose keys are a rotated part shared
by the heads and an unrotated part, values of their own head size, YaRN beyond the original context (rope.YaRN); a
mixture of experts (common/moe.py) after the first dense blocks, with a shared expert, sigmoid scores renormalized
and scaled, the auxiliary-loss-free selection bias and group-limited routing.

The published shapes: 671B is DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3); 16B is torchtitan's 16B, the
shape of DeepSeek-V2-Lite (softmax scores, no query latent, no groups).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torchtitan_lite.models.common.mla import MLA
from torchtitan_lite.models.common.moe import MoEArgs
from torchtitan_lite.models.common.rope import YaRN


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 2048
    n_layers: int = 27
    n_heads: int = 16
    q_rank: int = 0  # the query latent's size (q_lora_rank); 0: queries straight from the hidden states
    kv_rank: int = 512  # the key/value latent's size (kv_lora_rank)
    nope_dim: int = 128  # a head's unrotated query and key part (qk_nope_head_dim)
    rope_dim: int = 64  # its rotated part, the key's shared by the heads (qk_rope_head_dim)
    v_dim: int = 128  # a head's value size (v_head_dim)
    ffn_hidden: int = 10944  # a dense block's feed-forward hidden size (intermediate_size)
    vocab_size: int = -1  # set from the tokenizer
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    yarn: YaRN | None = YaRN()  # applied where max_seq_len exceeds its original context
    depth_init: bool = True  # output projections' std shrinks with depth (torchtitan's recipe)
    moe: MoEArgs | None = None
    mtp_depth: int = 0  # multi-token prediction's modules (num_nextn_predict_layers; common/mtp.py)
    # The decoder's choices DeepSeek-V3 makes at every size (class attributes, not fields).
    attention = MLA
    qk_norm = False
    rope_scaling = False  # Llama 3.1's; YaRN is `yarn`
    tie_embeddings = False

    @property
    def head_dim(self) -> int:  # a query's and key's head size: the softmax's 1/sqrt is of it
        return self.nope_dim + self.rope_dim

    @property
    def kv_heads(self) -> int:  # every head has keys and values of its own (expanded from the latent)
        return self.n_heads

    def with_(self, **changes) -> ModelArgs:
        return replace(self, **changes)


def deepseek_moe(num_experts: int, top_k: int, hidden: int, shared: int, first_dense: int, n_group: int = 1,
                 topk_group: int = 1, route_scale: float = 2.5) -> MoEArgs:
    """DeepSeek-V3's mixture: sigmoid scores, renormalized and scaled, the selection bias moved by 1e-3 a step
    (its bias update speed), no auxiliary loss (its sequence-wise one is moe.aux_loss_coeff's, off by default)."""
    return MoEArgs(num_experts=num_experts, top_k=top_k, hidden=hidden, shared_experts=shared, score_func="sigmoid",
                   renormalize=True, route_scale=route_scale, first_dense=first_dense, load_balance_coeff=1e-3,
                   n_group=n_group, topk_group=topk_group)


FLAVORS: dict[str, ModelArgs] = {
    # For the CPU and the suite: 2 blocks at the Llama debug model's width, the first dense; a query latent; keys of
    # 48 (32 unrotated + 16 rotated) and values of 32; 8 experts of 128 in 4 groups, a token's top 2 within its best
    # 2 groups, a shared expert; one MTP module, as 671B's.
    "debugmodel": ModelArgs(dim=256, n_layers=2, n_heads=8, q_rank=128, kv_rank=128, nope_dim=32, rope_dim=16,
                            v_dim=32, ffn_hidden=512, mtp_depth=1,
                            moe=deepseek_moe(8, 2, 128, shared=1, first_dense=1, n_group=4, topk_group=2)),
    # torchtitan's 16B, DeepSeek-V2-Lite's shape: softmax scores, neither renormalized nor scaled, no groups.
    "16B": ModelArgs(dim=2048, n_layers=27, n_heads=16, ffn_hidden=10944, yarn=YaRN(mscale=0.707),
                     moe=replace(deepseek_moe(64, 6, 1408, shared=2, first_dense=1, route_scale=1.0),
                                 score_func="softmax", renormalize=False)),
    "671B": ModelArgs(dim=7168, n_layers=61, n_heads=128, q_rank=1536, ffn_hidden=18432, mtp_depth=1,
                      moe=deepseek_moe(256, 8, 2048, shared=1, first_dense=3, n_group=8, topk_group=4)),
}
