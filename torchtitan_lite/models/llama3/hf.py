"""Our Llama in Hugging Face's terms: its parameter names, its weight layouts and its config.json, both ways (the
spec's HFAdapter, models/spec.py).

The files themselves are read and written by tools/hf_convert.py. Two decisions shape this file:
- Our attention rotates consecutive pairs of a head's dimensions (Meta's layout, model.apply_rope); Hugging Face's
  rotates the first half against the second (rotate_half). The same model in both is a permutation of the rows of
  wq and wk within each head, applied on export and undone on import, so both compute the same logits.
- Anything we cannot represent exactly (biases, another activation or RoPE variant, a head_dim of its own) is refused
  with one line naming it, never approximated. transformers is not imported here: the tests check against it.
"""

from __future__ import annotations

import json
import re

import torch

from torchtitan_lite.models.llama3.model import FLAVORS, ROPE_SCALING, ModelArgs
from torchtitan_lite.models.spec import ConversionError

LLAMA31_ROPE_SCALING = {"rope_type": "llama3", **ROPE_SCALING}  # model.rope_table's

# ---- Names and layouts

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_IN_LAYER = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
             "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
_OURS_LAYER, _HF_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.weight"), re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")


NO_MOE = "a mixture-of-experts model has no Hugging Face export yet (Mixtral's layout is to come): export a dense one"


def hf_name(name: str) -> str:
    """Our parameter name -> transformers' LlamaForCausalLM name."""
    if ".moe." in name:
        raise ConversionError(NO_MOE)
    if name in _TOP:
        return _TOP[name]
    i, part = _OURS_LAYER.fullmatch(name).groups()
    return f"model.layers.{i}.{_IN_LAYER[part]}.weight"


def our_name(name: str) -> str | None:
    """transformers' name -> ours, or None for a tensor our model has no place for."""
    if name in _TOP.values():
        return next(ours for ours, hf in _TOP.items() if hf == name)
    m = _HF_LAYER.fullmatch(name)
    part = next((ours for ours, hf in _IN_LAYER.items() if m and hf == m.group(2)), None)
    return f"layers.{m.group(1)}.{part}.weight" if part else None


def _rotated_heads(name: str, args: ModelArgs) -> int:
    """How many heads' rows RoPE rotates in this weight (0: none)."""
    m = _OURS_LAYER.fullmatch(name)
    return {"attention.wq": args.n_heads, "attention.wk": args.kv_heads}.get(m.group(2) if m else "", 0)


def to_hf_tensor(name: str, w: torch.Tensor, args: ModelArgs, inverse: bool = False) -> torch.Tensor:
    """Our weight `name` as transformers wants it (inverse: back to ours): the rows of wq and wk reordered per head
    from RoPE's pairs (x0, x1), (x2, x3) ... to halves (x0, x2, ...), (x1, x3, ...)."""
    if heads := _rotated_heads(name, args):
        rows, cols = w.shape
        w = w.view((heads, 2, -1, cols) if inverse else (heads, -1, 2, cols)).transpose(1, 2).reshape(rows, cols)
    return w


# ---- Configs

def hf_config(args: ModelArgs, bos_id: int, eos_id: int, dtype: torch.dtype) -> dict:
    """config.json in the form of Meta's published Llama 3.x folders (rope_theta and rope_scaling at the top level),
    which transformers 4 and 5 and other readers all understand."""
    if args.moe is not None:  # never an export that loads as a dense model, or routes otherwise than training did
        raise ConversionError(NO_MOE)
    name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling": dict(LLAMA31_ROPE_SCALING) if args.rope_scaling else None,
        "max_position_embeddings": args.max_seq_len, "bos_token_id": bos_id, "eos_token_id": eos_id,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "torch_dtype": name, "dtype": name,
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
    if arch != ["LlamaForCausalLM"] or kind != "llama":
        raise refuse(f"architectures {arch}, model_type {kind!r} (expected ['LlamaForCausalLM'], 'llama')")
    for key, ours in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                      ("partial_rotary_factor", 1.0), ("quantization_config", None)):
        if config.get(key, ours) != ours:
            raise refuse(f"{key} = {json.dumps(config[key])} (ours: {json.dumps(ours)})")
    needed = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
    if missing := [key for key in needed if key not in config]:
        raise ConversionError(f"config.json has no {missing[0]}")
    dim, heads, layers, hidden, vocab = (config[key] for key in needed)
    kv_heads = config.get("num_key_value_heads") or heads
    if dim % heads or config.get("head_dim") not in (None, dim // heads):
        raise refuse(f"head_dim {config.get('head_dim')} with hidden_size {dim} and {heads} heads (ours: "
                     "hidden_size / num_attention_heads)")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})  # transformers 5, or 4 and Meta
    theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type == "llama3":
        for key, ours in ROPE_SCALING.items():
            if rope.get(key) != ours:
                raise refuse(f"rope_scaling {key} = {rope.get(key)} (ours is Llama 3.1's, {ours})")
    elif rope_type != "default":
        raise refuse(f"rope_type {rope_type!r} (ours: default, or llama3 as in Llama 3.1)")
    multiple_of, multiplier = ffn_settings(dim, hidden)
    return ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=None if kv_heads == heads else kv_heads,
                     vocab_size=vocab, multiple_of=multiple_of, ffn_dim_multiplier=multiplier,
                     norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
                     rope_scaling=rope_type == "llama3", max_seq_len=config.get("max_position_embeddings", 2048))


def matching_flavor(args: ModelArgs) -> str | None:
    """The flavor that builds exactly this model (vocabulary and sequence length aside), if one does."""
    def shape(a: ModelArgs) -> tuple:
        return a.dim, a.n_layers, a.n_heads, a.kv_heads, a.ffn_hidden, a.norm_eps, a.rope_theta, a.rope_scaling
    return next((name for name, flavor in FLAVORS.items() if shape(flavor) == shape(args)), None)
