"""Our Qwen3 in Hugging Face's terms, as Qwen's published folders hold it: Qwen3ForCausalLM, and Qwen3MoeForCausalLM
for a mixture of experts (the spec's HFAdapter, models/spec.py). transformers is not imported here: the tests check
against it.

- Names and the RoPE permutation are the shared decoder's (models/common/hf.py), plus QK-norm's weights
  (self_attn.q_norm, k_norm), permuted as a head's rows of wq are: they scale a head's dimensions before the rotation.
- A mixture is Qwen3-MoE's: the router as mlp.gate, each routed expert's gate_proj, up_proj, down_proj a tensor of its
  own (as the published folders hold them, and as transformers' save_pretrained writes them though it fuses them in
  memory); its routing is ours (softmax, top k, renormalized when norm_topk_prob) without shared experts, sigmoid
  scores, a scale or a selection bias, which an export refuses: it must never route otherwise than training did.
- Tied embeddings (the small sizes): tie_word_embeddings and no lm_head.weight, as published; the converters write
  the table once and read the output projection from it (tools/hf_convert.py, checkpoint/hf_load.py).
- config.json is written in the published form (rope_theta at the top level, num_experts, output_router_logits off);
  transformers 5's forms (rope_parameters, num_local_experts) are read too. What ours cannot represent (biases, a
  sliding window, another activation or RoPE variant, dense blocks other than a first few or every k-th) is refused
  with one line naming it, never approximated.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from torchtitan_lite.models.common.hf import DECODER_LAYER, Names, check_routing, decoder_sizes, rope_settings
from torchtitan_lite.models.common.moe import MoEArgs
from torchtitan_lite.models.qwen3.model import FLAVORS, ModelArgs
from torchtitan_lite.models.spec import ConversionError

NAMES = Names("Qwen3 or Qwen3-MoE", {**DECODER_LAYER, "attention.q_norm": "self_attn.q_norm",
                                     "attention.k_norm": "self_attn.k_norm", "moe.router.gate": "mlp.gate"},
              expert="model.layers.{i}.mlp.experts.{e}.{part}.weight",
              expert_parts={"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})

_ARCHITECTURES = {"qwen3": ["Qwen3ForCausalLM"], "qwen3_moe": ["Qwen3MoeForCausalLM"]}
# What Qwen3-MoE's router computes, in our MoEArgs' terms (renormalize is its norm_topk_prob, either way).
QWEN3_MOE_ROUTING = {"shared_experts": 0, "score_func": "softmax", "route_scale": 1.0, "load_balance_coeff": 0.0}


# ---- Export

def qwen3_moe(args: ModelArgs) -> dict:
    """config.json's Qwen3-MoE keys, or ConversionError naming what its routing cannot hold."""
    moe = args.moe
    check_routing(moe, QWEN3_MOE_ROUTING, "Qwen3-MoE")
    return {"architectures": _ARCHITECTURES["qwen3_moe"], "model_type": "qwen3_moe",
            "moe_intermediate_size": moe.hidden or args.ffn_hidden, "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.renormalize,
            # Its dense blocks: transformers' rule is ours (every k-th block a mixture, the first few dense).
            "decoder_sparse_step": moe.every, "mlp_only_layers": list(range(moe.first_dense)),
            # The coefficient travels in router_aux_loss_coef; output_router_logits stays off, as in Qwen's own
            # folders: on, transformers adds the auxiliary loss to `outputs.loss`, which evaluations read as the LM's.
            "router_aux_loss_coef": moe.aux_loss_coeff, "output_router_logits": False}


def hf_config(args: ModelArgs, bos_id: int, eos_id: int, dtype: torch.dtype) -> dict:
    """config.json in the form of Qwen's published Qwen3 folders; Qwen3-MoE's for a mixture of experts."""
    name = str(dtype).removeprefix("torch.")
    return {
        "architectures": _ARCHITECTURES["qwen3"], "model_type": "qwen3", "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len, "bos_token_id": bos_id, "eos_token_id": eos_id,
        "tie_word_embeddings": args.tie_embeddings, "attention_bias": False, "hidden_act": "silu",
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers,
        "torch_dtype": name, "dtype": name, **(qwen3_moe(args) if args.moe is not None else {}),
    }


# ---- Import

def _moe_args(config: dict, refuse) -> MoEArgs:
    """Our MoEArgs of a Qwen3-MoE config.json (transformers' defaults where a key is absent)."""
    dense = config.get("mlp_only_layers") or []
    if dense != list(range(len(dense))):  # ours: the first few blocks dense (first_dense), not any others
        raise refuse(f"mlp_only_layers {dense} (ours: dense blocks only first, as [0, 1, ..., n-1])")
    experts = config.get("num_experts", config.get("num_local_experts", 128))  # published; transformers 5's
    if experts < 1 or config.get("decoder_sparse_step", 1) < 1:
        raise refuse(f"num_experts {experts}, decoder_sparse_step {config.get('decoder_sparse_step')} (no mixture)")
    return MoEArgs(num_experts=experts, top_k=config.get("num_experts_per_tok", 8),
                   hidden=config.get("moe_intermediate_size", 768), renormalize=bool(config.get("norm_topk_prob")),
                   every=config.get("decoder_sparse_step", 1), first_dense=len(dense),
                   # the folder's auxiliary-loss coefficient, whatever output_router_logits says: that only decides
                   # whether transformers adds the loss to its outputs.loss
                   aux_loss_coeff=config.get("router_aux_loss_coef", 0.001))


def _sliding_blocks(config: dict, layers: int) -> list[int]:
    """The blocks transformers' Qwen3 or Qwen3-MoE gives a sliding window: Qwen3's layer_types (by default those
    from max_window_layers on), every block of Qwen3-MoE; none without use_sliding_window."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    if config.get("model_type") == "qwen3_moe":
        return list(range(layers)) if window is not None else []
    start = config.get("max_window_layers", 28) if window is not None else layers
    types = config.get("layer_types") or ["sliding_attention" if i >= start else "full_attention"
                                          for i in range(layers)]
    return [i for i, kind in enumerate(types) if kind != "full_attention"]


def model_args_from_hf(config: dict) -> ModelArgs:
    """Our ModelArgs for a Hugging Face Qwen3 or Qwen3-MoE config.json, or ConversionError naming the first thing
    we lack."""
    def refuse(what: str) -> ConversionError:
        return ConversionError(f"not a model ours can represent: {what}")

    arch, kind = config.get("architectures"), config.get("model_type")
    if _ARCHITECTURES.get(kind) != arch:
        raise refuse(f"architectures {arch}, model_type {kind!r} (expected ['Qwen3ForCausalLM'], 'qwen3' or "
                     "['Qwen3MoeForCausalLM'], 'qwen3_moe')")
    dim, heads, layers, hidden, vocab = decoder_sizes(config, (("hidden_act", "silu"), ("attention_bias", False),
                                                               ("quantization_config", None)))
    if sliding := _sliding_blocks(config, layers):
        raise refuse(f"a sliding window of {config.get('sliding_window')} in blocks {sliding} (ours attends to the "
                     "whole context in every block)")
    theta, rope_type, _ = rope_settings(config)
    if rope_type != "default":
        raise refuse(f"rope_type {rope_type!r} (ours: default)")
    # transformers' defaults where absent: Qwen3's head_dim is 128, Qwen3-MoE's hidden_size / num_attention_heads.
    head_dim = config.get("head_dim") or (128 if kind == "qwen3" else dim // heads)
    return ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads,
                     head_dim=head_dim, ffn_hidden=hidden, vocab_size=vocab,
                     max_seq_len=config.get("max_position_embeddings", 32768),
                     norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=theta,
                     tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                     moe=_moe_args(config, refuse) if kind == "qwen3_moe" else None)


def matching_flavor(args: ModelArgs) -> str | None:
    """The flavor that builds exactly this model (vocabulary and sequence length aside), if one does."""
    def shape(a: ModelArgs) -> ModelArgs:
        # not the training-only settings: initialization, the auxiliary loss, the selection bias's step
        moe = a.moe and replace(a.moe, aux_loss_coeff=0.0, load_balance_coeff=0.0)
        return replace(a, vocab_size=-1, max_seq_len=0, depth_init=True, moe=moe)
    return next((name for name, flavor in FLAVORS.items() if shape(flavor) == shape(args)), None)
