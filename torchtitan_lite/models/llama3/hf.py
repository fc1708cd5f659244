"""Our Llama in Hugging Face's terms: its parameter names, its weight layouts and its config.json, both ways (the
spec's HFAdapter, models/spec.py).

The files themselves are read and written by tools/hf_convert.py. Two decisions shape this file:
- Our attention rotates consecutive pairs of a head's dimensions (Meta's layout, model.apply_rope); Hugging Face's
  rotates the first half against the second (rotate_half). The same model in both is a permutation of the rows of
  wq and wk within each head, applied on export and undone on import, so both compute the same logits (the shared
  decoder's names and this permutation are models/common/hf.py's, which Qwen3's adapter uses too).
- Anything we cannot represent exactly (biases, another activation or RoPE variant, a head_dim of its own) is refused
  with one line naming it, never approximated. transformers is not imported here: the tests check against it.
A mixture of experts is Mixtral's layout (MixtralForCausalLM, as its published folders hold it): the router as
`block_sparse_moe.gate`, each routed expert's w1, w2, w3 a tensor of its own, where ours are one 3-D tensor each
(`split`: the converter writes and reads them an expert at a time). What Mixtral's routing cannot hold (shared experts,
sigmoid scores, unnormalized or scaled weights, a selection bias, dense blocks among the MoE ones) is refused: an
export must never route otherwise than training did.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from torchtitan_lite.models.common.hf import (  # noqa: F401 - split, to_hf_tensor: the spec names them here
    DECODER_LAYER, Names, check_routing, decoder_sizes, rope_settings, split, to_hf_tensor)
from torchtitan_lite.models.common.moe import MoEArgs
from torchtitan_lite.models.common.rope import ROPE_SCALING
from torchtitan_lite.models.llama3.model import FLAVORS, ModelArgs
from torchtitan_lite.models.spec import ConversionError

LLAMA31_ROPE_SCALING = {"rope_type": "llama3", **ROPE_SCALING}  # model.rope_table's

# ---- Names and layouts (the shared decoder's, models/common/hf.py)

NAMES = Names("Llama or Mixtral", {**DECODER_LAYER, "moe.router.gate": "block_sparse_moe.gate"},
              expert="model.layers.{i}.block_sparse_moe.experts.{e}.{part}.weight",
              expert_parts={"w1": "w1", "w2": "w2", "w3": "w3"})
hf_name, our_name = NAMES.hf_name, NAMES.our_name


# ---- Configs

# What Mixtral's router computes, in our MoEArgs' terms: softmax over every routed expert, top k, renormalized.
MIXTRAL_ROUTING = {"shared_experts": 0, "score_func": "softmax", "renormalize": True, "route_scale": 1.0, "every": 1,
                   "first_dense": 0, "load_balance_coeff": 0.0}


def mixtral(args: ModelArgs) -> dict:
    """config.json's Mixtral keys for an MoE model, or ConversionError naming what Mixtral's layout cannot hold."""
    moe = args.moe
    check_routing(moe, MIXTRAL_ROUTING, "Mixtral")
    if args.rope_scaling:
        raise ConversionError("Mixtral's layout has no Llama 3.1 RoPE scaling: export an MoE model without it")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": moe.hidden or args.ffn_hidden, "num_local_experts": moe.num_experts,
            # The coefficient travels in router_aux_loss_coef; output_router_logits stays off, as in Mixtral's own
            # folders: on, transformers adds the auxiliary loss to `outputs.loss`, which evaluations read as the LM's.
            "num_experts_per_tok": moe.top_k, "output_router_logits": False,
            "router_aux_loss_coef": moe.aux_loss_coeff,
            "sliding_window": None}


def hf_config(args: ModelArgs, bos_id: int, eos_id: int, dtype: torch.dtype) -> dict:
    """config.json in the form of Meta's published Llama 3.x folders (rope_theta and rope_scaling at the top level),
    which transformers 4 and 5 and other readers all understand; Mixtral's for a mixture of experts."""
    name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling": dict(LLAMA31_ROPE_SCALING) if args.rope_scaling else None,
        "max_position_embeddings": args.max_seq_len, "bos_token_id": bos_id, "eos_token_id": eos_id,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "torch_dtype": name, "dtype": name, **(mixtral(args) if args.moe is not None else {}),
    }


def ffn_settings(dim: int, hidden: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) for which ModelArgs.ffn_hidden is `hidden`: the default rounding when it
    gives that size, else rounding up to `hidden` itself from a multiplier that lands at or just below it."""
    base = int(8 * dim / 3)
    for multiple_of, multiplier in ((256, None), (hidden, None if base <= hidden else hidden / base)):
        if ModelArgs(dim=dim, multiple_of=multiple_of, ffn_dim_multiplier=multiplier).ffn_hidden == hidden:
            return multiple_of, multiplier
    raise ConversionError(f"intermediate_size {hidden} cannot be expressed by multiple_of / ffn_dim_multiplier")


def model_args_from_hf(config: dict) -> ModelArgs:
    """Our ModelArgs for a Hugging Face Llama config.json, or ConversionError naming the first thing we lack."""
    def refuse(what: str) -> ConversionError:
        return ConversionError(f"not a model ours can represent: {what}")

    arch, kind = config.get("architectures"), config.get("model_type")
    if (arch, kind) not in ((["LlamaForCausalLM"], "llama"), (["MixtralForCausalLM"], "mixtral")):
        raise refuse(f"architectures {arch}, model_type {kind!r} (expected ['LlamaForCausalLM'], 'llama' or "
                     "['MixtralForCausalLM'], 'mixtral')")
    moe = None
    if kind == "mixtral":
        if config.get("sliding_window") not in (None, 0) and config["sliding_window"] < config.get(
                "max_position_embeddings", 0):
            raise refuse(f"sliding_window {config['sliding_window']} (ours attends to the whole context)")
        moe = MoEArgs(num_experts=config.get("num_local_experts", 8), top_k=config.get("num_experts_per_tok", 2),
                      # the folder's auxiliary-loss coefficient, whatever output_router_logits says: that only
                      # decides whether transformers adds the loss to its outputs.loss
                      hidden=config["intermediate_size"], aux_loss_coeff=config.get("router_aux_loss_coef", 0.0))
    dim, heads, layers, hidden, vocab = decoder_sizes(config, (
        ("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("partial_rotary_factor", 1.0),
        ("quantization_config", None)))
    kv_heads = config.get("num_key_value_heads") or heads
    if dim % heads or config.get("head_dim") not in (None, dim // heads):
        raise refuse(f"head_dim {config.get('head_dim')} with hidden_size {dim} and {heads} heads (ours: "
                     "hidden_size / num_attention_heads)")
    theta, rope_type, rope = rope_settings(config)  # transformers 5's rope_parameters, or 4's and Meta's keys
    if rope_type == "llama3":
        for key, ours in ROPE_SCALING.items():
            if rope.get(key) != ours:
                raise refuse(f"rope_scaling {key} = {rope.get(key)} (ours is Llama 3.1's, {ours})")
    elif rope_type != "default":
        raise refuse(f"rope_type {rope_type!r} (ours: default, or llama3 as in Llama 3.1)")
    multiple_of, multiplier = ffn_settings(dim, hidden) if moe is None else (256, None)  # MoE: the experts' own
    return ModelArgs(moe=moe, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=None if kv_heads == heads else kv_heads,
                     vocab_size=vocab, multiple_of=multiple_of, ffn_dim_multiplier=multiplier,
                     norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
                     rope_scaling=rope_type == "llama3", max_seq_len=config.get("max_position_embeddings", 2048))


def matching_flavor(args: ModelArgs) -> str | None:
    """The flavor that builds exactly this model (vocabulary and sequence length aside), if one does."""
    def shape(a: ModelArgs) -> tuple:
        # an expert's width, however said; not the training-only settings
        moe = a.moe and replace(a.moe, hidden=a.moe.hidden or a.ffn_hidden, aux_loss_coeff=0.0, load_balance_coeff=0.0)
        return a.dim, a.n_layers, a.n_heads, a.kv_heads, a.ffn_hidden, a.norm_eps, a.rope_theta, a.rope_scaling, moe
    return next((name for name, flavor in FLAVORS.items() if shape(flavor) == shape(args)), None)
