"""Our DeepSeek-V3 in Hugging Face's terms, as DeepSeek's published folders hold it: DeepseekV3ForCausalLM (the
spec's HFAdapter, models/spec.py). transformers is not imported here: the tests check against it.

- Names: the shared decoder's top-level tensors and norms (models/common/hf.py), latent attention's own projections
  (q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj), the router as
  mlp.gate with the selection bias as mlp.gate.e_score_correction_bias, the shared expert as mlp.shared_experts and
  each routed expert's gate_proj, up_proj, down_proj a tensor of its own (as published, and as transformers'
  save_pretrained writes them though it fuses them in memory).
- Multi-token prediction: num_nextn_predict_layers modules, module k as layer num_hidden_layers + k (`bind`, since
  that index is the args'). DeepSeek's folders hold there the embedding and lm_head again; ours shares them, so an
  export writes them twice and an import reads the main ones and skips the copies unread, as transformers' MtpModel
  does: comparing them would read two vocabulary-sized tensors more on every rank that starts from a folder.
  DeepseekV3ForCausalLM itself ignores that layer (its generate's use_mtp drafts with it).
- No RoPE permutation: ours rotates consecutive pairs of the rotated part, which is transformers' rope_interleave
  (its default and what DeepSeek publishes). It returns the pairs' halves apart, but queries and keys alike, so the
  scores are ours.
- YaRN: ours applies it only where the context exceeds its original one (DeepSeek's reference, torchtitan), where
  transformers applies whatever rope_scaling says at any length. So rope_scaling is written only where ours applies
  it at max_position_embeddings, with mscale = mscale_all_dim (cos and sin unscaled, the softmax scale's factor
  mscale_all_dim's, as ours), and an import refuses one that ours would not apply.
- What DeepseekV3ForCausalLM cannot hold is refused in one line, never approximated: softmax scores (its router is
  sigmoid only), dense blocks other than the first few, no shared expert, tied embeddings, a norm eps other than the
  1e-6 its latent norms always use.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import torch

from torchtitan_lite.models.common.hf import (  # noqa: F401 - split: the spec names it here
    Names, check_routing, decoder_sizes, rope_settings, split)
from torchtitan_lite.models.common.moe import MoEArgs
from torchtitan_lite.models.common.rope import YaRN
from torchtitan_lite.models.deepseek_v3.model import FLAVORS, ModelArgs
from torchtitan_lite.models.spec import ConversionError, HFAdapter

NAMES = Names("DeepSeek-V3", {
    "attention.wq": "self_attn.q_proj", "attention.wq_a": "self_attn.q_a_proj",
    "attention.q_norm": "self_attn.q_a_layernorm", "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a": "self_attn.kv_a_proj_with_mqa", "attention.kv_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj", "attention.wo": "self_attn.o_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
    "moe.router.gate": "mlp.gate", "moe.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "moe.shared_experts.w3": "mlp.shared_experts.up_proj", "moe.shared_experts.w2": "mlp.shared_experts.down_proj"},
    expert="model.layers.{i}.mlp.experts.{e}.{part}.weight",
    expert_parts={"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})
# The selection bias: a buffer, not a weight, so not in the shared table.
_OURS_BIAS, _HF_BIAS = (re.compile(r"layers\.(\d+)\.moe\.router\.expert_bias"),
                        re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias"))
# An MTP module's own tensors: ours under mtp.{k}., theirs under the layer after the blocks' (model.layers.{n + k}.).
MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
           "norm.weight": "shared_head.norm.weight"}
# What that layer holds again of the main model, theirs -> ours: the paper's MTP modules share them with it, as ours do.
MTP_COPIES = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
_OURS_MTP, _HF_ANY_LAYER = re.compile(r"mtp\.(\d+)\.(.+)"), re.compile(r"model\.layers\.(\d+)\.(.+)")

# What DeepseekV3ForCausalLM's router computes, in our MoEArgs' terms; the rest (scale, renormalization, groups, the
# shared experts' count, the first dense blocks) are config keys of its own.
DEEPSEEK_V3_ROUTING = {"score_func": "sigmoid", "every": 1}
LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm, whatever rms_norm_eps says
# An imported model's bias step: DeepSeek-V3's bias update speed. Its config.json has no key for it, and ours holds a
# selection bias (the folder's e_score_correction_bias) only with load balancing on.
IMPORTED_BALANCE_COEFF = 1e-3


def hf_name(name: str) -> str:
    """Our tensor name (a routed expert's piece: the 3-D weight's name + ".e") -> transformers'."""
    if m := _OURS_BIAS.fullmatch(name):
        return f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias"
    return NAMES.hf_name(name)


def our_name(name: str) -> str | None:
    """transformers' tensor name -> ours, or None for a tensor our model has no place for."""
    if m := _HF_BIAS.fullmatch(name):
        return f"layers.{m.group(1)}.moe.router.expert_bias"
    return NAMES.our_name(name)


def bind(hf: HFAdapter, args: ModelArgs) -> HFAdapter:
    """The adapter of a model of `args` (HFAdapter.bind): as DeepSeek publishes MTP module k, layer n_layers + k of
    the folder, with a block's names (its block is one), its own four tensors, and copies of the embedding and the
    output projection. The unbound names know no MTP module, since the layer's index depends on n_layers."""
    n = args.n_layers

    def mtp_hf_name(name: str) -> str:
        if m := _OURS_MTP.fullmatch(name):
            layer, part = n + int(m[1]), m[2]
            return f"model.layers.{layer}.{MTP_OWN[part]}" if part in MTP_OWN else hf_name(f"layers.{layer}.{part}")
        return hf_name(name)

    def mtp_our_name(name: str) -> str | None:
        m = _HF_ANY_LAYER.fullmatch(name)
        if m is None or int(m[1]) < n:
            return our_name(name)
        # beyond mtp_depth too: the converters then name the tensor the folder's model has no place for
        k, part = int(m[1]) - n, m[2]
        own = next((ours for ours, theirs in MTP_OWN.items() if theirs == part), None)
        block = our_name(f"model.layers.{n}.{part}")
        return f"mtp.{k}.{own}" if own else block and f"mtp.{k}.{block.removeprefix(f'layers.{n}.')}"

    copies = {f"model.layers.{n + k}.{theirs}": ours for k in range(args.mtp_depth)
              for theirs, ours in MTP_COPIES.items()}
    return replace(hf, hf_name=mtp_hf_name, our_name=mtp_our_name, copies=copies, bind=None)


def to_hf_tensor(name: str, w: torch.Tensor, args: ModelArgs, inverse: bool = False) -> torch.Tensor:
    """Every weight as it is, both ways: with rope_interleave, transformers rotates the pairs ours rotates."""
    return w


def absent(args: ModelArgs) -> dict[str, torch.Tensor]:
    """What a DeepseekV3ForCausalLM folder holds that our model lacks: a zero selection bias (the same routing as
    none) in each mixture block of a model trained without load balancing."""
    moe = args.moe
    if moe is None or moe.load_balance_coeff > 0:
        return {}
    # MTP module k's block is built as block n_layers + k, the index its bias has in the folder too
    return {hf_name(f"layers.{i}.moe.router.expert_bias"): torch.zeros(moe.num_experts)
            for i in range(args.n_layers + args.mtp_depth) if moe.is_moe(i)}


# ---- Export

def _refuse_export(what: str) -> ConversionError:
    return ConversionError(f"DeepSeek-V3's layout cannot hold {what}")


def yarn_scaling(args: ModelArgs) -> dict | None:
    """rope_scaling of the args: their YaRN where ours applies it at max_seq_len, else None."""
    yarn = args.yarn
    if yarn is None or not yarn.applies(args.max_seq_len):
        return None
    return {"rope_type": "yarn", "factor": yarn.factor, "original_max_position_embeddings": yarn.original_seq_len,
            "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow, "mscale": yarn.mscale,
            "mscale_all_dim": yarn.mscale,
            # mscale 0: transformers would scale cos and sin by YaRN's default factor without this
            **({"attention_factor": 1.0} if not yarn.mscale else {})}


def deepseek_moe(args: ModelArgs) -> dict:
    """config.json's mixture keys (a dense model: every block before first_k_dense_replace, the MTP modules' too, as
    their layers' indices say), or ConversionError."""
    moe = args.moe
    if moe is None:
        return {"first_k_dense_replace": args.n_layers + args.mtp_depth, "n_routed_experts": 1,
                "num_experts_per_tok": 1, "n_shared_experts": 1, "moe_intermediate_size": args.ffn_hidden,
                "n_group": 1, "topk_group": 1}
    check_routing(moe, DEEPSEEK_V3_ROUTING, "DeepSeek-V3")
    if not moe.shared_experts:
        raise _refuse_export("moe.shared_experts = 0 (its mixture always adds a shared expert)")
    if moe.num_experts // moe.n_group < 2:
        raise _refuse_export(f"moe.n_group = {moe.n_group} of one expert each (it scores a group by its best two)")
    return {"first_k_dense_replace": moe.first_dense, "moe_layer_freq": moe.every,
            "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "n_shared_experts": moe.shared_experts, "moe_intermediate_size": moe.hidden or args.ffn_hidden,
            "scoring_func": moe.score_func, "topk_method": "noaux_tc", "norm_topk_prob": moe.renormalize,
            "routed_scaling_factor": moe.route_scale, "n_group": moe.n_group, "topk_group": moe.topk_group}


def hf_config(args: ModelArgs, bos_id: int, eos_id: int, dtype: torch.dtype) -> dict:
    """config.json in the form of DeepSeek's published DeepSeek-V3 folders (rope_theta and rope_scaling at the top
    level), or ConversionError naming what DeepseekV3ForCausalLM cannot hold."""
    if args.tie_embeddings:
        raise _refuse_export("tied embeddings")
    if args.norm_eps != LATENT_NORM_EPS:  # its latent norms' eps is fixed: ours would differ there
        raise _refuse_export(f"norm_eps = {args.norm_eps} (its latent norms': {LATENT_NORM_EPS})")
    name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads, "q_lora_rank": args.q_rank or None, "kv_lora_rank": args.kv_rank,
        "qk_nope_head_dim": args.nope_dim, "qk_rope_head_dim": args.rope_dim, "v_head_dim": args.v_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling": yarn_scaling(args), "rope_interleave": True, "max_position_embeddings": args.max_seq_len,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "tie_word_embeddings": False, "attention_bias": False,
        "hidden_act": "silu", "num_nextn_predict_layers": args.mtp_depth,
        "torch_dtype": name, "dtype": name, **deepseek_moe(args),
    }


# ---- Import

def _yarn(config: dict, rope: dict, refuse) -> YaRN:
    """Our YaRN of a yarn rope_scaling, as transformers computes it, or ConversionError."""
    original = rope.get("original_max_position_embeddings", config.get("max_position_embeddings", 4096))
    factor = rope.get("factor") or config.get("max_position_embeddings", 4096) / original
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim") or 0.0
    # transformers' factor on cos and sin: ours has none, so it must be 1
    attention = rope.get("attention_factor") or (
        (0.1 * mscale * math.log(factor) + 1) / (0.1 * mscale_all_dim * math.log(factor) + 1)
        if mscale and mscale_all_dim else 0.1 * math.log(factor) + 1 if factor > 1 else 1.0)
    if abs(attention - 1.0) > 1e-12 or rope.get("truncate", True) is not True:
        raise refuse(f"rope_scaling mscale {mscale}, mscale_all_dim {mscale_all_dim}, attention_factor "
                     f"{rope.get('attention_factor')}, truncate {rope.get('truncate', True)} (ours: cos and sin "
                     "unscaled, mscale = mscale_all_dim, truncated)")
    yarn = YaRN(factor=float(factor), original_seq_len=original, beta_fast=float(rope.get("beta_fast") or 32),
                beta_slow=float(rope.get("beta_slow") or 1), mscale=float(mscale_all_dim))
    if not yarn.applies(config.get("max_position_embeddings", 4096)):
        raise refuse(f"YaRN at max_position_embeddings {config.get('max_position_embeddings')} within its original "
                     f"{original} (ours applies YaRN only beyond the original context)")
    return yarn


def _moe_args(config: dict, layers: int, refuse) -> MoEArgs | None:
    """Our MoEArgs of a DeepSeek-V3 config.json (transformers' defaults where a key is absent), None where every
    block is dense."""
    first_dense = config.get("first_k_dense_replace", 3)
    if first_dense >= layers:
        return None
    for key, ours in (("scoring_func", "sigmoid"), ("moe_layer_freq", 1), ("topk_method", "noaux_tc")):
        if config.get(key, ours) != ours:
            raise refuse(f"{key} {config[key]!r} (DeepseekV3ForCausalLM computes {ours!r})")
    if not config.get("n_shared_experts", 1):
        raise refuse("n_shared_experts 0 (ours: a shared expert of moe_intermediate_size or more)")
    return MoEArgs(num_experts=config.get("n_routed_experts", 256), top_k=config.get("num_experts_per_tok", 8),
                   hidden=config.get("moe_intermediate_size", 2048), shared_experts=config.get("n_shared_experts", 1),
                   score_func="sigmoid", renormalize=bool(config.get("norm_topk_prob", True)),
                   route_scale=float(config.get("routed_scaling_factor", 2.5)), first_dense=first_dense,
                   load_balance_coeff=IMPORTED_BALANCE_COEFF, n_group=config.get("n_group", 8) or 1,
                   topk_group=config.get("topk_group", 4) or 1)


def model_args_from_hf(config: dict) -> ModelArgs:
    """Our ModelArgs for a Hugging Face DeepSeek-V3 config.json, or ConversionError naming the first thing we lack."""
    def refuse(what: str) -> ConversionError:
        return ConversionError(f"not a model ours can represent: {what}")

    arch, kind = config.get("architectures"), config.get("model_type")
    if (arch, kind) != (["DeepseekV3ForCausalLM"], "deepseek_v3"):
        raise refuse(f"architectures {arch}, model_type {kind!r} (expected ['DeepseekV3ForCausalLM'], "
                     "'deepseek_v3')")
    dim, heads, layers, hidden, vocab = decoder_sizes(config, (
        ("hidden_act", "silu"), ("attention_bias", False), ("tie_word_embeddings", False),
        ("rope_interleave", True), ("rms_norm_eps", LATENT_NORM_EPS), ("quantization_config", None)))
    if config.get("num_key_value_heads") not in (None, heads):
        raise refuse(f"num_key_value_heads {config['num_key_value_heads']} (ours: num_attention_heads, {heads})")
    theta, rope_type, rope = rope_settings(config)
    if rope_type not in ("default", "yarn"):
        raise refuse(f"rope_type {rope_type!r} (ours: default, or yarn as in DeepSeek-V3)")
    return ModelArgs(dim=dim, n_layers=layers, n_heads=heads, q_rank=config.get("q_lora_rank", 1536) or 0,
                     kv_rank=config.get("kv_lora_rank", 512), nope_dim=config.get("qk_nope_head_dim", 128),
                     rope_dim=config.get("qk_rope_head_dim", 64), v_dim=config.get("v_head_dim", 128),
                     ffn_hidden=hidden, vocab_size=vocab, max_seq_len=config.get("max_position_embeddings", 4096),
                     norm_eps=LATENT_NORM_EPS, rope_theta=theta,
                     yarn=_yarn(config, rope, refuse) if rope_type == "yarn" else None,
                     moe=_moe_args(config, layers, refuse),
                     # transformers' default where absent, as DeepSeek-V3 publishes it
                     mtp_depth=config.get("num_nextn_predict_layers", 1))


def matching_flavor(args: ModelArgs) -> str | None:
    """The flavor that builds exactly this model at its context (vocabulary aside): YaRN counts only where it
    applies there, as it does for the model."""
    def shape(a: ModelArgs) -> ModelArgs:
        # an expert's width, however said; not the training-only settings
        moe = a.moe and replace(a.moe, hidden=a.moe.hidden or a.ffn_hidden, aux_loss_coeff=0.0,
                                load_balance_coeff=0.0, router_z_loss=0.0)
        yarn = a.yarn if a.yarn is not None and a.yarn.applies(a.max_seq_len) else None
        return replace(a, vocab_size=-1, max_seq_len=0, depth_init=True, yarn=yarn, moe=moe)
    return next((name for name, flavor in FLAVORS.items()
                 if shape(flavor.with_(max_seq_len=args.max_seq_len)) == shape(args)), None)
