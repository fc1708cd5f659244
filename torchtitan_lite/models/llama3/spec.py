"""Llama 3 as the rest of the package sees it: the shared decoder on this folder's args and flavors, with its Hugging
Face adapter (hf.py), in one ModelSpec (models/spec.py), which models/registry.py registers as "llama3"."""

from __future__ import annotations

from torchtitan_lite.models.common.decoder import decoder_spec
from torchtitan_lite.models.llama3 import hf
from torchtitan_lite.models.llama3.model import FLAVORS
from torchtitan_lite.models.spec import HFAdapter

SPEC = decoder_spec(
    "llama3", FLAVORS,
    hf=HFAdapter(hf_name=hf.hf_name, our_name=hf.our_name, to_hf_tensor=hf.to_hf_tensor, config=hf.hf_config,
                 args_from_config=hf.model_args_from_hf, flavor_of=hf.matching_flavor, split=hf.split),
    # Meta's tokenizer for the dense sizes, Mistral's for Mixtral.
    published_vocab={"8B": 128_256, "70B": 128_256, "405B": 128_256, "mixtral_8x7b": 32_000, "mixtral_8x22b": 32_000},
    bitwise_layouts=True,  # dense and mixture (tests/multiprocess/test_layout_invariant.py)
)
