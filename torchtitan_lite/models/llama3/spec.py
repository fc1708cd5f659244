"""Llama 3 as the rest of the package sees it: this folder's pieces named in one ModelSpec (models/spec.py), which
models/registry.py registers as "llama3"."""

from __future__ import annotations

from torchtitan_lite.models.common.decoder import Decoder, flops_per_token, param_group
from torchtitan_lite.models.common.moe import configured
from torchtitan_lite.models.common.parallelize import tp_plan, tp_sizes
from torchtitan_lite.models.llama3 import hf
from torchtitan_lite.models.llama3.model import FLAVORS
from torchtitan_lite.models.spec import HFAdapter, ModelSpec

SPEC = ModelSpec(
    name="llama3",
    model_class=Decoder,
    flavors=FLAVORS,
    tp_plan=tp_plan,
    tp_sizes=tp_sizes,
    flops_per_token=flops_per_token,
    param_group=param_group,
    configure=lambda args, cfg: args.with_(moe=configured(args.moe, cfg.moe, cfg.model.flavor)),
    hf=HFAdapter(hf_name=hf.hf_name, our_name=hf.our_name, to_hf_tensor=hf.to_hf_tensor, config=hf.hf_config,
                 args_from_config=hf.model_args_from_hf, flavor_of=hf.matching_flavor,
                 split=hf.split),
    blocks_alike=True,  # dense blocks; only their initialization depends on the index (depth_init)
    # Meta's tokenizer for the dense sizes, Mistral's for Mixtral.
    published_vocab={"8B": 128_256, "70B": 128_256, "405B": 128_256, "mixtral_8x7b": 32_000, "mixtral_8x22b": 32_000},
)
