"""What every architecture's Hugging Face adapter (llama3/hf.py, qwen3/hf.py) shares, written once: the shared
decoder's parameter names in transformers' Llama-family terms, the RoPE row permutation, reading rope_theta.

- Names: transformers' Llama, Mixtral and Qwen3 name a block's tensors alike (self_attn.q_proj, mlp.gate_proj,
  input_layernorm, ...) and differ in a few parts (QK-norm, the router, where the routed experts live). `Names` holds
  one architecture's table; our routed experts are one 3-D weight per projection where theirs are a tensor per
  expert (`split`: the converters write and read them an expert at a time).
- RoPE: ours rotates consecutive pairs of a head's dimensions (Meta's layout, rope.py); transformers' rotates the
  first half against the second (rotate_half). The same model in both is a permutation of each head's rows of wq and
  wk, and of anything applied per head dimension before the rotation (Qwen3's QK-norm weight, one head's worth),
  applied on export and undone on import, so both compute the same logits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property

import torch

from torchtitan_lite.models.spec import ConversionError

# The top-level tensors and a block's, in transformers' Llama-family names (a dense block's feed-forward).
TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
DECODER_LAYER = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                 "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                 "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                 "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
                 "ffn_norm": "post_attention_layernorm"}
_OURS_LAYER, _HF_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.weight"), re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")
# One routed expert's piece of our 3-D weight (its name + "." + the expert; "*" for the whole weight).
_EXPERT = re.compile(r"layers\.(\d+)\.moe\.experts\.(w[123])\.(\d+|\*)")


def split(name: str) -> bool:
    """Whether our tensor `name` is one Hugging Face tensor per index of its first dim (the routed experts')."""
    return ".moe.experts." in name


@dataclass(frozen=True)
class Names:
    """One architecture's Hugging Face names of our parameters, both ways."""
    what: str  # the architecture, for the error of a name it has no place for
    layer: dict[str, str]  # a block's part (our module path) -> theirs
    # A routed expert's tensor, from {i} (block), {e} (expert) and {part}, our w1/w2/w3 -> their part (expert_parts)
    expert: str
    expert_parts: dict[str, str]

    def hf_name(self, name: str) -> str:
        """Our parameter name (an expert's piece: the 3-D weight's name + ".e") -> transformers' name; the whole 3-D
        weight's is its experts' names with "*" for the expert."""
        if m := _EXPERT.fullmatch(name if not split(name) or name[-1].isdigit() else name + ".*"):
            i, w, e = m.groups()
            return self.expert.format(i=i, e=e, part=self.expert_parts[w])
        if name in TOP:
            return TOP[name]
        m = _OURS_LAYER.fullmatch(name)
        if m is None or m.group(2) not in self.layer:
            raise ConversionError(f"{name} has no place in a Hugging Face {self.what}")
        return f"model.layers.{m.group(1)}.{self.layer[m.group(2)]}.weight"

    def our_name(self, name: str) -> str | None:
        """transformers' name -> ours (an expert's piece for a routed expert's tensor), or None for a tensor our
        model has no place for."""
        if name in TOP.values():
            return next(ours for ours, hf in TOP.items() if hf == name)
        if m := self._hf_expert.fullmatch(name):
            w = next(ours for ours, theirs in self.expert_parts.items() if theirs == m["part"])
            return f"layers.{m['i']}.moe.experts.{w}.{m['e']}"
        m = _HF_LAYER.fullmatch(name)
        part = next((ours for ours, hf in self.layer.items() if m and hf == m.group(2)), None)
        return f"layers.{m.group(1)}.{part}.weight" if part else None

    @cached_property
    def _hf_expert(self) -> re.Pattern:
        parts = "|".join(map(re.escape, self.expert_parts.values()))
        return re.compile(self.expert.replace(".", r"\.").format(i=r"(?P<i>\d+)", e=r"(?P<e>\d+)",
                                                                 part=f"(?P<part>{parts})"))


def _rotated_heads(name: str, args) -> int:
    """How many heads' rows RoPE's layout orders in this weight (0: none); QK-norm's weight is one head's."""
    m = _OURS_LAYER.fullmatch(name)
    part = m.group(2) if m else ""
    if part in ("attention.q_norm", "attention.k_norm"):
        return 1
    return {"attention.wq": args.n_heads, "attention.wk": args.kv_heads}.get(part, 0)


def to_hf_tensor(name: str, w: torch.Tensor, args, inverse: bool = False) -> torch.Tensor:
    """Our weight `name` as transformers wants it (inverse: back to ours): the rows of wq and wk, and QK-norm's
    weight, reordered per head from RoPE's pairs (x0, x1), (x2, x3) ... to halves (x0, x2, ...), (x1, x3, ...)."""
    if heads := _rotated_heads(name, args):
        rest = w.shape[1:]
        w = w.view((heads, 2, -1, *rest) if inverse else (heads, -1, 2, *rest)).transpose(1, 2).reshape(w.shape)
    return w


def rope_settings(config: dict, default_theta: float = 10000.0) -> tuple[float, str, dict]:
    """(rope theta, rope type, the scaling's other keys) of a config.json in any of its forms: transformers 5's
    rope_parameters, or transformers 4's and the published folders' rope_theta and rope_scaling."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", config.get("rope_theta", default_theta))
    return float(theta), rope.pop("rope_type", rope.pop("type", "default")), rope


def check_routing(moe, routing: dict, layout: str) -> None:
    """ConversionError unless the mixture `moe` (MoEArgs) routes as `routing` says, `layout`'s routing in our terms:
    an export must never route otherwise than training did."""
    for key, theirs in routing.items():
        if getattr(moe, key) != theirs:
            raise ConversionError(f"{layout}'s layout cannot hold moe.{key} = {getattr(moe, key)} ({layout}'s: "
                                  f"{theirs}): a mixture of experts exports only with {layout}'s routing")


def decoder_sizes(config: dict, fixed: tuple[tuple[str, object], ...]) -> tuple[int, int, int, int, int]:
    """(hidden_size, num_attention_heads, num_hidden_layers, intermediate_size, vocab_size) of a config.json, once the
    keys whose value ours fixes (`fixed`: (key, ours) pairs; an absent key counts as ours) hold it; else
    ConversionError naming the first that differs, or the first size missing."""
    for key, ours in fixed:
        if config.get(key, ours) != ours:
            raise ConversionError(f"not a model ours can represent: {key} = {json.dumps(config[key])} (ours: "
                                  f"{json.dumps(ours)})")
    needed = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
    if missing := [key for key in needed if key not in config]:
        raise ConversionError(f"config.json has no {missing[0]}")
    return tuple(config[key] for key in needed)
