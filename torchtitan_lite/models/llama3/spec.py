"""Llama 3 as the rest of the package sees it: this folder's pieces named in one ModelSpec (models/spec.py), which
models/registry.py registers as "llama3"; and the FLOPs of a token, MFU's numerator."""

from __future__ import annotations

from torch import nn

from torchtitan_lite.models.llama3 import hf
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer, count_params
from torchtitan_lite.models.llama3.parallelize import tp_plan, tp_sizes
from torchtitan_lite.models.moe import configured, inactive_params
from torchtitan_lite.models.spec import HFAdapter, ModelSpec
from torchtitan_lite.runtime import metrics


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs of a token of the whole model (on meta will do) at `seq_len`: the dense formula of
    runtime/metrics.py over the parameters outside the embedding table that a token uses (of the routed experts, its
    top k), and the attention's S x S scores."""
    n_params, n_embedding = count_params(model)
    a = model.args
    return metrics.flops_per_token(n_params - inactive_params(model), a.n_layers, a.n_heads, a.head_dim, seq_len,
                                   n_embedding)


SPEC = ModelSpec(
    name="llama3",
    model_class=Transformer,
    flavors=FLAVORS,
    tp_plan=tp_plan,
    tp_sizes=tp_sizes,
    flops_per_token=flops_per_token,
    configure=lambda args, cfg: args.with_(moe=configured(args.moe, cfg.moe, cfg.model.flavor)),
    hf=HFAdapter(hf_name=hf.hf_name, our_name=hf.our_name, to_hf_tensor=hf.to_hf_tensor, config=hf.hf_config,
                 args_from_config=hf.model_args_from_hf, flavor_of=hf.matching_flavor,
                 split=hf.split),
    blocks_alike=True,  # dense blocks; only their initialization depends on the index (depth_init)
)
