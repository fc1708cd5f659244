"""The model specs by name: what `model.name` selects.

The built-in architectures register here, once each, at import; a program may register one more before it calls
train.run() (tests/multiprocess/toy_model.py trains one that way). The names a config may use are the registry's,
never a second list: an unknown one is refused with the registered names, by `train.py --check` among the rest.
"""

from __future__ import annotations

from torchtitan_lite.config import ConfigError, did_you_mean
from torchtitan_lite.models.deepseek_v3 import spec as deepseek_v3
from torchtitan_lite.models.llama3 import spec as llama3
from torchtitan_lite.models.qwen3 import spec as qwen3
from torchtitan_lite.models.spec import ModelSpec

SPECS: dict[str, ModelSpec] = {}  # name -> spec, in registration order


def register(spec: ModelSpec) -> ModelSpec:
    """Adds `spec` under its name, which no other spec may hold."""
    if SPECS.get(spec.name, spec) is not spec:
        raise ValueError(f"a model named {spec.name!r} is already registered")
    SPECS[spec.name] = spec
    return spec


def get(name: str) -> ModelSpec:
    """The spec registered as `name`, or one ConfigError line naming the registered ones."""
    if name not in SPECS:
        raise ConfigError(f"model.name {name!r} is not a registered model: choose one of {', '.join(SPECS)}"
                          f"{did_you_mean(name, list(SPECS))}")
    return SPECS[name]


register(llama3.SPEC)
register(qwen3.SPEC)
register(deepseek_v3.SPEC)
