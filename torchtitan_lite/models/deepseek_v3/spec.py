"""DeepSeek-V3 as the rest of the package sees it: the shared decoder on this folder's args and flavors, with the MLA
TP plan, MLA's FLOPs and its Hugging Face adapter (hf.py), in one ModelSpec (models/spec.py), which
models/registry.py registers as "deepseek_v3"."""

from __future__ import annotations

from torch import nn

from torchtitan_lite.models.common.decoder import Decoder, configure, count_params, param_group
from torchtitan_lite.models.common.moe import inactive_params
from torchtitan_lite.models.common.parallelize import mla_tp_plan, tp_sizes
from torchtitan_lite.models.deepseek_v3 import hf
from torchtitan_lite.models.deepseek_v3.model import FLAVORS
from torchtitan_lite.models.spec import HFAdapter, ModelSpec
from torchtitan_lite.runtime import metrics


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """The decoder's count (decoder.flops_per_token) with MLA's attention: each head's scores over keys of head_dim
    and its sum over values of v_dim, so the mean of the two stands for the head size. Multi-token prediction's
    modules count as blocks (their parameters are among the model's), and each depth multiplies by the output
    projection once more."""
    n_params, n_embedding = count_params(model)
    a = model.args
    depth = a.mtp_depth
    return metrics.flops_per_token(n_params - inactive_params(model) + depth * model.output.weight.numel(),
                                   a.n_layers + depth, a.n_heads, (a.head_dim + a.v_dim) / 2, seq_len, n_embedding)


SPEC = ModelSpec(name="deepseek_v3", model_class=Decoder, flavors=FLAVORS, tp_plan=mla_tp_plan, tp_sizes=tp_sizes,
                 flops_per_token=flops_per_token, param_group=param_group, configure=configure,
                 hf=HFAdapter(hf_name=hf.hf_name, our_name=hf.our_name, to_hf_tensor=hf.to_hf_tensor,
                              config=hf.hf_config, args_from_config=hf.model_args_from_hf,
                              flavor_of=hf.matching_flavor, split=hf.split, absent=hf.absent, bind=hf.bind),
                 published_vocab={"16B": 102_400, "671B": 129_280})
