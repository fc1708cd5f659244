"""DeepSeek-V3 (models/deepseek_v3/): its published sizes, its FLOPs, and its pieces against transformers'
DeepseekV3, written independently of ours: the group-limited router with the selection bias, and YaRN's rotary
frequencies and softmax scale. The whole model's logits against transformers': tests/test_hf_deepseek_v3.py; every
layout against one process: tests/multiprocess/test_moe_layouts.py (the deepseek_* runs)."""

import math

import pytest
import torch

from torchtitan_lite.models import registry
from torchtitan_lite.models.common import moe
from torchtitan_lite.models.common.decoder import Decoder
from torchtitan_lite.models.common.mla import MLA
from torchtitan_lite.models.common.rope import YaRN, rope_table
from torchtitan_lite.models.deepseek_v3.model import FLAVORS

SPEC = registry.get("deepseek_v3")


@pytest.mark.parametrize("flavor, vocab, total, active", [("671B", 129_280, 671.03e9, 37.5e9),
                                                          ("16B", 102_400, 15.71e9, 2.66e9)])
def test_the_published_sizes_have_their_published_parameter_counts(flavor, vocab, total, active):
    """DeepSeek-V3's 671B total and 37B activated (its paper, without the 14B MTP module); torchtitan's 16B (the
    shape of DeepSeek-V2-Lite: 15.7B, 2.4B activated without the embedding table). DeepSeek-V3's MTP module is its
    published folder's 14B (685B in all) with the copies of the embedding table and output projection that folder
    holds beside it, which ours shares."""
    with torch.device("meta"):
        model = Decoder(SPEC.args(flavor, vocab, 4096))
    mtp = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    if flavor == "671B":
        assert abs(mtp + 2 * vocab * model.args.dim - 14e9) / 14e9 < 0.05, mtp
        model.mtp = None
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - total) / total < 1e-3, n
    assert abs(n - moe.inactive_params(model) - active) / active < 0.02, n - moe.inactive_params(model)


@pytest.mark.parametrize("mtp_depth", [0, 1])
def test_mlas_flops_count_its_key_and_value_head_sizes(mtp_depth):
    """6 x the parameters a token uses, and each head's scores over keys of head_dim and sum over values of v_dim; an
    MTP module's block attends as the others do, and its logits take the output projection once more."""
    args = SPEC.args("debugmodel", 512, 64).with_(mtp_depth=mtp_depth)
    with torch.device("meta"):
        model = Decoder(args)
    n = sum(p.numel() for p in model.parameters()) - moe.inactive_params(model) - 512 * args.dim
    n += mtp_depth * 512 * args.dim
    attention = 6 * (args.n_layers + mtp_depth) * args.n_heads * 64 * (args.head_dim + args.v_dim)
    assert SPEC.flops_per_token(model, 64) == 6 * n + attention


@pytest.mark.parametrize("bias", [False, True])
def test_group_limited_routing_is_transformers(bias):
    """Our router against transformers' DeepseekV3TopkRouter on the same gate and selection bias: the same experts
    for every token (order aside) and the same weights, for 16 experts in 4 groups, top 4 within the best 2."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    args = moe.MoEArgs(num_experts=16, top_k=4, score_func="sigmoid", route_scale=2.5, n_group=4, topk_group=2,
                       load_balance_coeff=1e-3 if bias else 0.0)
    ours = moe.Router(64, args)
    gen = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(ours.gate.weight, std=0.5, generator=gen)
    theirs = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4,
                                                   n_group=4, topk_group=2, routed_scaling_factor=2.5))
    theirs.weight.data.copy_(ours.gate.weight)
    if bias:
        ours.expert_bias.copy_(torch.randn(16, generator=gen) * 0.3)
        theirs.e_score_correction_bias.copy_(ours.expert_bias)
    x = torch.randn(200, 64, generator=gen)
    weights, experts, *_ = ours(x)
    _, their_weights, their_experts = theirs(x)
    order, their_order = experts.argsort(-1), their_experts.argsort(-1)
    assert torch.equal(experts.gather(-1, order), their_experts.gather(-1, their_order))
    torch.testing.assert_close(weights.gather(-1, order), their_weights.gather(-1, their_order))
    assert all(len(set(g.tolist())) <= 2 for g in experts // 4)  # every token's experts within 2 groups
    ours.args = moe.MoEArgs(**{**args.__dict__, "n_group": 1, "topk_group": 1})
    unlimited = ours(x)[1]
    assert (unlimited.sort(-1).values != experts.sort(-1).values).any(-1).sum() > 10  # the limit chose for many


def test_yarn_is_transformers():
    """The rotary frequencies and the softmax scale of DeepSeek-V3's YaRN (factor 40 over 4096 positions, mscale 1)
    against transformers' yarn rope initialization and its mscale, where the context exceeds the original one; below
    it, plain rotary (DeepSeek's reference applies YaRN only beyond)."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_get_mscale

    args = FLAVORS["671B"].with_(max_seq_len=8192, vocab_size=1)
    config = DeepseekV3Config(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                               "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                              max_position_embeddings=8192)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert attention_factor == 1.0
    table = rope_table(args)
    angles = torch.outer(torch.arange(8192, dtype=torch.float32), inv_freq)
    torch.testing.assert_close(table, torch.complex(angles.cos(), angles.sin()))
    assert args.yarn.softmax_factor(8192) == pytest.approx(yarn_get_mscale(40.0, 1.0) ** 2)
    plain = rope_table(args.with_(max_seq_len=4096))
    assert YaRN().softmax_factor(4096) == 1.0 and not torch.allclose(plain, table[:4096])


def test_mla_attends_with_keys_and_values_of_their_own_head_sizes():
    """One MLA forward written out by hand: the latents, the shared rotated key, the heads' keys of 48 and values
    of 32, causal softmax attention."""
    args = FLAVORS["debugmodel"].with_(vocab_size=64, max_seq_len=8)
    mla = MLA(args)
    gen = torch.Generator().manual_seed(1)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=gen)
    x = torch.randn(2, 8, args.dim, generator=gen)
    rope = rope_table(args)
    out = mla(x, rope)

    def rotate(t):  # consecutive pairs turned by their position's angle
        pairs = torch.view_as_complex(t.unflatten(-1, (-1, 2)))
        return torch.view_as_real(pairs * rope[:8, None]).flatten(-2)

    q = mla.wq_b(mla.q_norm(mla.wq_a(x))).view(2, 8, 8, 48)
    kv, k_rope = mla.wkv_a(x).split([args.kv_rank, 16], -1)
    kv = mla.wkv_b(mla.kv_norm(kv)).view(2, 8, 8, 64)
    k = torch.cat([kv[..., :32], rotate(k_rope[:, :, None]).expand(-1, -1, 8, -1)], -1)
    q = torch.cat([q[..., :32], rotate(q[..., 32:])], -1)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(48)
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    want = mla.wo(torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), kv[..., 32:]).reshape(2, 8, -1))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_decoding_with_the_kv_cache_is_the_full_forward():
    """The decoder's KV cache holds MLA's keys and values of their own head sizes (48 and 32): a prompt then a chunk
    through the cache give the logits of one forward over both."""
    from torchtitan_lite.tools.generation import forward_cached

    model = Decoder(SPEC.args("debugmodel", 64, 32))
    model.init_weights(seed=0)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model.kv_cache(2, 32)
        cached = torch.cat([forward_cached(model, tokens[:, :8], cache),
                            forward_cached(model, tokens[:, 8:], cache)], 1)
        torch.testing.assert_close(cached, model(tokens), rtol=1e-5, atol=1e-5)
