"""MXFP8 grouped matmuls for a mixture's routed experts through torchao.prototype.moe_training (what torchtitan's
"quantize.grouped_mm.mx" converter applies): which experts convert, torchao's config for the recipe, the refusals,
and why no layout changes a scale.

A converted GroupedExperts (models/common/moe.py) computes its three grouped matmuls, forward and backward, with
torchao's `_to_mxfp8_then_scaled_grouped_mm`: each operand is cast to MXFP8 (the OCP MX format: blocks of 32 elements
along the matmul's inner dim, each block one power-of-two E8M0 scale, its elements e4m3; the scale rounded up from
max|block| / 448, RCEIL, as Blackwell's conversion instruction does) and the casts are multiplied. torchtitan reaches
that function through a parameter subclass whose __torch_function__ catches torch._grouped_mm; here the experts call
it themselves (GroupedExperts.grouped_mm), so their parameters stay plain tensors and checkpoints, FSDP's all-gather,
EP's DTensors and the optimizer see nothing new. torchao pads each expert's group of slots to a multiple of 32 with
zero rows (its kernels' alignment) and cuts the padding off the results: zeros change no block's max.

Where each scale's block lies, and why a layout cannot move it (float8.py argues the same for the linears):
- the forward and the input gradient scale each slot's row (along dim, or its output gradient's along the expert's
  hidden) and each expert's weight (along its rows, or its columns): a slot's row travels whole (EP's all-to-all
  moves rows; TP leaves the mixture whole on every tp rank) and an expert's weight is whole wherever it is used (FSDP
  gathers it; EP splits experts, never one);
- the weight gradient scales blocks of 32 slots of one expert (the padding keeps a block within one expert): they
  depend on which slots an expert computes together, and in which order. Without EP that is a rank's micro-batch, as
  on one process with the same micro-batches (float8's tensorwise scale has that rule too); with EP, the same
  micro-batch of every rank of the ep group, arriving by source rank and regrouped by expert in that order
  (parallel/expert_parallel.py), which is one process's order of those sequences: dp ranks take contiguous slices of
  the global batch. Under tensor or context parallelism a rank routes part of every sequence, so an expert's blocks
  would mix other slots than any one process's: refused, except with mxfp8_wgrad_with_hp, whose weight gradient is a
  high-precision matmul, every remaining scale a slot row's or a weight's. (A power-of-two scale changes only how the
  elements below 2**-6 of it, e4m3's subnormals, round: a small change, but one a layout must not make.)

Where Blackwell's MXFP8 kernels are missing, float8.emulate runs torchao's own emulation (KernelPreference.EMULATED):
the same casts (to_mx), then the dequantized bf16 values multiplied with fp32 accumulation, into the compute dtype.
torch 2.13's torch._grouped_mm refuses an output dtype other than its inputs' (on every device; a TODO of its
GroupedMMUtils.h), which an fp32 run asks of that emulation: `_install_grouped_mm_out_dtype` is the one stub, the same
bf16 values multiplied in fp32. torchao is imported only where experts convert.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch
from torch import nn

from torchtitan_lite.config import ConfigError, JobConfig
from torchtitan_lite.models.common.moe import GroupedExperts, ZeroGradOfEmpty
from torchtitan_lite.quantization import float8

BLOCK = 32  # MXFP8's block: the elements one scale covers, and the slots torchao pads each expert's group to
# float8.moe_recipe_name -> torchao's MXFP8TrainingRecipe (RCEIL scales, as Blackwell computes them)
RECIPES = {"mxfp8": "MXFP8_RCEIL", "mxfp8_wgrad_with_hp": "MXFP8_RCEIL_WGRAD_WITH_HP"}


def enabled(cfg: JobConfig) -> bool:
    return bool(cfg.float8.moe_fqns)


def converts(fqn: str, module: nn.Module, moe_fqns: list[str]) -> bool:
    """Whether `module` at `fqn` is routed experts that a moe_fqns entry names (torchtitan's rule: the name contains
    it). Shared experts are dense feed-forwards, nn.Linear's: float8.enable_float8_linear's concern."""
    return isinstance(module, GroupedExperts) and any(entry in fqn for entry in moe_fqns)


def converted_names(model: nn.Module, moe_fqns: list[str]) -> list[str]:
    return [fqn for fqn, module in model.named_modules() if converts(fqn, module, moe_fqns)]


def check(cfg: JobConfig, model: nn.Module, dims) -> None:
    """The refusals, each one line: `model` is the whole model on meta, `dims` the layout (parallel.dims)."""
    f8, flavor = cfg.float8, cfg.model.flavor
    if not enabled(cfg):
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("float8.moe_fqns needs torchao: pip install torchao (requirements-dev.txt has it)")
    experts = {fqn: m for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)}
    if not experts:
        raise ConfigError(f"float8.moe_fqns converts a mixture's routed experts, and model.flavor {flavor} has none: "
                          "drop float8.moe_fqns, or set moe.num_experts")
    for entry in f8.moe_fqns:
        if not any(entry in fqn for fqn in experts):
            raise ConfigError(f"float8.moe_fqns entry {entry!r} names no routed experts of the model (e.g. "
                              f"{next(iter(experts))!r}): a renamed layer would silently stay in high precision")
    for fqn in converted_names(model, f8.moe_fqns):
        hidden, dim = experts[fqn].w1.shape[1:]
        if dim % BLOCK or hidden % BLOCK:
            raise ConfigError(f"MXFP8 scales blocks of {BLOCK} elements along each matmul's inner dim, so the "
                              f"experts' dim and hidden must be multiples of {BLOCK} ({fqn}: dim {dim}, hidden "
                              f"{hidden}): set moe.hidden to one, or drop float8.moe_fqns")
    if cfg.training.mixed_precision_param == "float16":
        raise ConfigError("float8.moe_fqns with training.mixed_precision_param float16 is refused: MXFP8's scales "
                          "and fp16's loss scale would fight over the same range; train MXFP8 in bfloat16")
    if (dims.tp > 1 or dims.cp > 1) and f8.moe_recipe_name == "mxfp8":
        raise ConfigError("float8.moe_recipe_name mxfp8 under tensor or context parallelism is refused: its weight "
                          "gradients scale blocks of 32 of an expert's slots, and there each rank routes part of "
                          "every sequence, so the blocks would hold other slots than one process's: use "
                          "mxfp8_wgrad_with_hp (weight gradients in high precision), or TP and CP 1")
    if cfg.compile.enable:
        raise ConfigError("float8.moe_fqns trains eager so far (torchao pads each expert's slots to 32 by sizes its "
                          "emulation reads on the host, which compile cannot trace, and compiled MXFP8 experts are "
                          "untested): drop compile.enable")
    if not f8.emulate and not has_mxfp8_grouped_mm():
        raise ConfigError("MXFP8 grouped matmuls need an NVIDIA GPU of compute capability 10.x (B200, GB200) and "
                          "torchao's CUDA build, and this machine has neither: set float8.emulate for the numerics "
                          "alone")


def has_mxfp8_grouped_mm() -> bool:
    """Where torchao's MXFP8 grouped matmul runs its own kernels: SM100 with torchao's CUDA extension loaded."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10):
        return False
    float8.import_torchao("torchao.prototype.moe_training")
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _SM100_KERNELS_AVAILABLE

    return bool(_SM100_KERNELS_AVAILABLE)


def torchao_config(cfg: JobConfig):
    """torchao's MXFP8TrainingOpConfig for the recipe: emulated where float8.emulate says, and padding each expert's
    slots itself (torchtitan pads them in its own dispatch instead; ours leaves that to torchao)."""
    float8.import_torchao("torchao.prototype.moe_training")
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization.quantize_.common import KernelPreference

    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe[RECIPES[cfg.float8.moe_recipe_name]])
    emulated = KernelPreference.EMULATED if cfg.float8.emulate else config.kernel_preference
    return dataclasses.replace(config, kernel_preference=emulated, pad_token_groups_for_grouped_mm=True)


def convert(model: nn.Module, cfg: JobConfig) -> None:
    """Points the routed experts of `model` (on meta, before parallelism) that float8.moe_fqns names at torchao's MXFP8
    grouped matmul, in place; their parameters, and so their checkpoints, stay as they were."""
    config = torchao_config(cfg)
    if cfg.float8.emulate:
        _install_grouped_mm_out_dtype()
    for fqn, module in model.named_modules():
        if converts(fqn, module, cfg.float8.moe_fqns):
            module.grouped_mm = functools.partial(grouped_mm, config=config)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, config) -> torch.Tensor:
    """moe.grouped's call, x @ w[e].T for each expert e's rows of x, in MXFP8 (torchao's function for `config`), its
    output in x's dtype. Empty experts' weight gradients are zeroed as moe.grouped zeroes them: Blackwell's grouped
    kernels are the ones that write garbage there."""
    from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

    w = ZeroGradOfEmpty.apply(w, counts > 0)
    return _quantize_then_scaled_grouped_mm(x, w.transpose(-2, -1), dataclasses.replace(config, out_dtype=x.dtype),
                                            offs=counts.cumsum(0).to(torch.int32))


@functools.cache
def _install_grouped_mm_out_dtype() -> None:
    """torchao's emulation multiplies the dequantized bf16 values into the compute dtype (out_dtype), which torch's
    grouped GEMM refuses where that is fp32. Then the same bf16 values are multiplied in fp32, what a bf16 kernel with
    an fp32 output computes (exact products, fp32 sums); every other call reaches torch's op as before."""
    real = torch._grouped_mm

    def grouped_mm_any_out_dtype(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
        if out_dtype not in (None, mat_a.dtype):
            return real(mat_a.to(out_dtype), mat_b.to(out_dtype), offs=offs, bias=bias)
        return real(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)

    torch._grouped_mm = grouped_mm_any_out_dtype
