"""Float8 training through torchao: which linears convert, torchao's config for the recipe, and what float8 changes in
the layouts around them.

A converted linear casts its input, weight and output gradient to float8 with dynamic scales (max |x| of the whole
tensor, tensorwise; of each row, rowwise) and multiplies in float8. The scale is the one place a layout could change
the numbers: a shard's max is not the tensor's. So every scale is taken over the tensor one process would see:
- tensor parallelism works on DTensors, whose max reduces over the mesh; under tensorwise the TP styles cast to float8
  before their all-gather (torchao's Float8ColwiseParallel, ...), so the gather moves 1 byte an element;
- FSDP's float8 all-gather casts each weight shard with the whole weight's max: torchao all-reduces it per weight
  before the gather, or, with the precompute, all of them at once after the optimizer step (and here once before the
  first step too, so step 1 uses the same scale as every later one);
- a micro-batch's activations are scaled as a whole, so a layout equals one process with the same micro-batches;
- context parallelism splits each sequence, and its shards' maxima are no sequence's: refused (check()).

gloo has no float8 type, so a float8 all-gather is made to move the same bytes as uint8 on every backend
(`_install_byte_gather`): the CPU tests run the GPU's path, and NCCL moves bytes alike whatever their dtype. torchao is an
optional dependency; it is imported only where float8 is on. The routed experts' grouped matmuls are
mxfp8_experts.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import sys

import torch
from torch import nn

from torchtitan_lite.config import ConfigError, JobConfig

NEVER = "output"  # the logits' projection: its error reaches the loss undamped (torchtitan's configs filter it too)


def enabled(cfg: JobConfig) -> bool:
    return cfg.float8.enable_float8_linear


def all_gathers_float8(cfg: JobConfig, fsdp: bool) -> bool:
    return enabled(cfg) and fsdp and cfg.float8.enable_fsdp_float8_all_gather


def converts(fqn: str, module: nn.Module, filter_fqns: list[str]) -> bool:
    """Whether the linear at `fqn` becomes a Float8Linear: not the output layer, both dimensions multiples of 16 (the
    float8 matmul's requirement), and no filter entry in its name."""
    if not isinstance(module, nn.Linear) or fqn == NEVER:
        return False
    out_features, in_features = module.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0 and not any(f in fqn for f in filter_fqns)


def converted_names(model: nn.Module, filter_fqns: list[str]) -> list[str]:
    """The names of the linears `model` (on meta is fine) would convert."""
    return [fqn for fqn, module in model.named_modules() if converts(fqn, module, filter_fqns)]


def check(cfg: JobConfig, model: nn.Module, dims) -> None:
    """float8's refusals, each one line: `model` is the whole model on meta (filter entries must name a linear of it,
    whichever stage holds it), `dims` the layout (parallel.dims.ParallelDims)."""
    f8 = cfg.float8
    if not enabled(cfg):
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("float8.enable_float8_linear needs torchao: pip install torchao (requirements-dev.txt has it)")
    if cfg.training.mixed_precision_param == "float16":
        raise ConfigError("float8 with training.mixed_precision_param float16 is refused: float8's scales and fp16's "
                          "loss scale would fight over the same range; train float8 in bfloat16")
    if dims.cp > 1:
        raise ConfigError("float8 under context parallelism is refused: each rank would scale its share of a "
                          "sequence by that share's own max, not the sequence's; use TP, FSDP or PP with float8")
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        raise ConfigError(f"float8.enable_fsdp_float8_all_gather needs recipe_name tensorwise (got "
                          f"{f8.recipe_name!r}): torchao all-gathers float8 weights with one scale a tensor only")
    if all_gathers_float8(cfg, dims.fsdp) and dims.tp > 1 and not f8.precompute_float8_dynamic_scale_for_fsdp:
        raise ConfigError("float8.enable_fsdp_float8_all_gather under tensor parallelism needs "
                          "float8.precompute_float8_dynamic_scale_for_fsdp: torchao's per-weight scale takes the max "
                          "over the FSDP shards only, so each TP shard of a weight would get a scale of its own")
    for entry in f8.filter_fqns:
        if not any(entry in fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)):
            raise ConfigError(f"float8.filter_fqns entry {entry!r} names no linear of the model (e.g. "
                              f"{converted_names(model, [])[0]!r}): a renamed layer would silently convert")
    if not f8.emulate and not has_float8_matmul():
        raise ConfigError("float8 matmuls need an NVIDIA GPU of compute capability 8.9 or later (H100, L40S, B200), "
                          "and this machine has none: set float8.emulate for the numerics alone")


def ignored_options(cfg: JobConfig, fsdp: bool) -> list[str]:
    """[float8] options set away from their defaults that this run never reads (parallelize.warn_ignored_options)."""
    f8, default = cfg.float8, type(cfg.float8)()  # not the fields' .default: a list option has a default_factory
    # The routed experts' MXFP8 (mxfp8_experts.py) is on with moe_fqns alone, and float8.emulate serves it too.
    experts = {"moe_fqns", "moe_recipe_name", *(("emulate",) if f8.moe_fqns else ())}
    reasons = []
    if not f8.moe_fqns and f8.moe_recipe_name != default.moe_recipe_name:
        reasons.append("float8.moe_fqns is empty: float8.moe_recipe_name ignored")
    if not enabled(cfg):
        changed = [f"float8.{f.name}" for f in dataclasses.fields(f8)
                   if f.name not in experts and getattr(f8, f.name) != getattr(default, f.name)]
        if changed:
            reasons.append(f"float8.enable_float8_linear is off: {', '.join(changed)} ignored")
        return reasons
    if not fsdp and f8.enable_fsdp_float8_all_gather:
        reasons.append("no FSDP in this layout: float8.enable_fsdp_float8_all_gather ignored")
    if f8.precompute_float8_dynamic_scale_for_fsdp and not all_gathers_float8(cfg, fsdp):
        reasons.append("no float8 all-gather: float8.precompute_float8_dynamic_scale_for_fsdp ignored")
    return reasons


def has_float8_matmul() -> bool:
    """Where torch._scaled_mm runs fast: the CPU build has a reference kernel (seconds a matmul), so it counts as none."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@functools.cache
def import_torchao(module: str = "torchao.float8") -> None:
    """Imports torchao's `module` with its import-time warnings silenced: its CUDA kernels' libraries fail to load on a
    CPU-only machine, and it registers Enums with torch's pytree the old way; neither matters to training."""
    quieted = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quieted]
    for log in quieted:
        log.setLevel(logging.ERROR)
    try:
        importlib.import_module(module)
    finally:
        for log, level in zip(quieted, levels):
            log.setLevel(level)


def torchao_config(cfg: JobConfig, fsdp: bool):
    import_torchao()
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(cfg.float8.recipe_name)
    return dataclasses.replace(config, emulate=cfg.float8.emulate,
                               enable_fsdp_float8_all_gather=all_gathers_float8(cfg, fsdp))


def convert(model: nn.Module, cfg: JobConfig, fsdp: bool) -> None:
    """Swaps `model`'s convertible linears (on meta, before parallelism) for torchao's Float8Linear, in place. Their
    parameters keep nn.Linear's names, so checkpoints load into a run with float8 on or off."""
    import_torchao()
    from torchao.float8 import convert_to_float8_training

    _install_byte_gather()
    if cfg.float8.recipe_name == "rowwise" and cfg.compile.enable:
        import torch._inductor.config  # noqa: PLC0415 - inductor's import costs seconds: compiled rowwise runs only

        # Inductor's fused casts must round as eager's do, or the power-of-two scales part (pytorch#150859).
        torch._inductor.config.emulate_precision_casts = True
    convert_to_float8_training(model, config=torchao_config(cfg, fsdp),
                               module_filter_fn=functools.partial(_filter, filter_fqns=cfg.float8.filter_fqns))


def _filter(module: nn.Module, fqn: str, filter_fqns: list[str]) -> bool:
    return converts(fqn, module, filter_fqns)


def is_float8(module: nn.Module) -> bool:
    linear = sys.modules.get("torchao.float8.float8_linear")  # not imported: no run converted anything
    return linear is not None and isinstance(module, linear.Float8Linear)


def tp_styles(module: nn.Module):
    """(colwise, rowwise, prepare-input) TP styles for the linears of `module` (a block): torchao's float8 ones, which
    cast before communicating, when every linear of the block is a tensorwise Float8Linear; else None."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not linears or not all(is_float8(m) for m in linears):  # first: without float8, torchao may be absent
        return None
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                       PrepareFloat8ModuleInput)

    if any(m.config.cast_config_input.scaling_granularity is not ScalingGranularity.TENSORWISE for m in linears):
        return None
    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


class ScalePrecompute:
    """With FSDP's float8 all-gather and `precompute_float8_dynamic_scale_for_fsdp`: every float8 weight's scale from
    one all-reduce of their maxima, after each optimizer step and once before the first (a no-op otherwise)."""

    def __init__(self, cfg: JobConfig, fsdp: bool, parts: list[nn.Module]):
        self.parts = parts if all_gathers_float8(cfg, fsdp) and cfg.float8.precompute_float8_dynamic_scale_for_fsdp \
            else []

    def __call__(self) -> None:
        if self.parts:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            for part in self.parts:
                precompute_float8_dynamic_scale_for_fsdp(part)


@functools.cache
def _install_byte_gather() -> None:
    """torchao's float8 tensors all-gather their float8 data; gloo refuses float8 dtypes. The same bytes as uint8
    work on every backend, so the one implementation serves the GPU and the CPU tests."""
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    def gather_bytes(op, args, kwargs=None):
        x = args[0]
        assert x._scale.numel() == 1, "a float8 all-gather keeps one scale: tensorwise only"
        data = op(x._data.contiguous().view(torch.uint8), *args[1:], **(kwargs or {})).view(x._data.dtype)
        return Float8TrainingTensor(data, x._scale, x._orig_dtype, x._linear_mm_config, x._gemm_input_role)

    for op in (torch.ops.c10d_functional.all_gather_into_tensor.default,
               torch.ops._c10d_functional.all_gather_into_tensor.default):
        FLOAT8_OPS_TABLE[op] = gather_bytes
