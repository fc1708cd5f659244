"""Qwen3 as the rest of the package sees it: the shared decoder on this folder's args and flavors, with its Hugging
Face adapter (hf.py), in one ModelSpec (models/spec.py), which models/registry.py registers as "qwen3"."""

from __future__ import annotations

from torchtitan_lite.models.common import hf as common_hf
from torchtitan_lite.models.common.decoder import decoder_spec
from torchtitan_lite.models.qwen3 import hf
from torchtitan_lite.models.qwen3.model import FLAVORS
from torchtitan_lite.models.spec import HFAdapter

SPEC = decoder_spec(
    "qwen3", FLAVORS,
    hf=HFAdapter(hf_name=hf.NAMES.hf_name, our_name=hf.NAMES.our_name, to_hf_tensor=common_hf.to_hf_tensor,
                 config=hf.hf_config, args_from_config=hf.model_args_from_hf, flavor_of=hf.matching_flavor,
                 split=common_hf.split),
    # Every published size's embedding table (151,643 tokens and specials, padded).
    published_vocab={name: 151_936 for name in FLAVORS if not name.startswith("debugmodel")},
)
