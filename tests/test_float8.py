"""Float8 training (quantization/float8.py): which linears convert, each converted linear's numerics against fp32,
and the configurations refused in one line. The layouts' parity is tests/multiprocess/test_float8.py's."""

import copy
import importlib.util
import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

from torchtitan_lite.config import load_config
from torchtitan_lite.models.common.decoder import TransformerBlock
from torchtitan_lite.models.llama3.model import FLAVORS, ModelArgs, Transformer
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.parallelize import warn_ignored_options
from torchtitan_lite.quantization import float8

pytest.importorskip("torchao")  # an optional dependency, which requirements-dev.txt installs

BLOCK = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
         "feed_forward.w3")
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
F8 = ("--float8.enable_float8_linear", "--float8.emulate")


def converted(args: ModelArgs, *overrides: str) -> tuple[set[str], nn.Module]:
    with torch.device("meta"):
        model = Transformer(args)
    float8.convert(model, load_config([*F8, *overrides]), fsdp=False)
    return {name for name, module in model.named_modules() if float8.is_float8(module)}, model


@pytest.mark.parametrize("flavor", ["debugmodel", "8B"])
def test_every_block_linear_converts_and_the_output_layer_never(flavor):
    args = FLAVORS[flavor].with_(vocab_size=2048)
    names, model = converted(args)
    assert names == {f"layers.{i}.{linear}" for i in range(args.n_layers) for linear in BLOCK}
    assert type(model.output) is nn.Linear
    with torch.device("meta"):  # checkpoints load across float8 on and off: the parameter names are nn.Linear's
        assert list(model.state_dict()) == list(Transformer(args).state_dict())


def test_linears_off_the_float8_grid_and_filtered_ones_stay_in_high_precision():
    # dim 48, head_dim 12: wk and wv are 12 x 48, off float8's 16-multiple grid; the FFN's hidden size is 128.
    args = ModelArgs(dim=48, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=64, multiple_of=8)
    names, _ = converted(args, "--float8.filter_fqns", "feed_forward.w3,layers.1.attention.wq")
    assert names == {"layers.0.attention.wq", "layers.0.attention.wo", "layers.0.feed_forward.w1",
                     "layers.0.feed_forward.w2", "layers.1.attention.wo", "layers.1.feed_forward.w1",
                     "layers.1.feed_forward.w2"}


def sqnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    return (20 * torch.log10(reference.norm() / (reference - other).norm())).item()


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_linear_meets_torchaos_sqnr_thresholds(recipe):
    """A debug-model block as initialized (the Llama recipe's stds): each linear's output within 18 dB of fp32 and its
    input and weight gradients within 17 dB (torchao's own test thresholds), on unit-variance inputs as the norms
    give them."""
    from torchao.float8.float8_linear import Float8Linear

    block = TransformerBlock(0, FLAVORS["debugmodel"])
    torch.manual_seed(3)
    block.init_weights(lambda weight, std: nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std))
    config = float8.torchao_config(load_config([*F8, "--float8.recipe_name", recipe]), fsdp=False)
    generator = torch.Generator().manual_seed(0)
    for name in BLOCK:
        linear = block.get_submodule(name)
        low = Float8Linear.from_float(copy.deepcopy(linear), config=config)
        x = torch.randn(2, 64, linear.in_features, generator=generator, requires_grad=True)
        x8 = x.detach().clone().requires_grad_()
        y, y8 = linear(x), low(x8)
        grad = torch.randn(y.shape, generator=generator)
        y.backward(grad)
        y8.backward(grad)
        assert sqnr(y, y8) >= 18, (recipe, name, sqnr(y, y8))
        assert sqnr(linear.weight.grad, low.weight.grad) >= 17, (recipe, name)
        assert sqnr(x.grad, x8.grad) >= 17, (recipe, name)


@pytest.mark.parametrize("world, overrides, line", [
    (1, ["--float8.enable_float8_linear"], "float8 matmuls need an NVIDIA GPU of compute capability 8.9 or later "
     "(H100, L40S, B200), and this machine has none: set float8.emulate for the numerics alone"),
    (1, [*F8, "--float8.recipe_name", "mxfp8"], "float8.recipe_name must be one of tensorwise, rowwise, "
     "rowwise_with_gw_hp (got 'mxfp8')"),
    (4, [*F8, "--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
     "float8.enable_fsdp_float8_all_gather needs recipe_name tensorwise (got 'rowwise'): torchao all-gathers float8 "
     "weights with one scale a tensor only"),
    (1, [*F8, "--float8.filter_fqns", "output,attention.wkv"], "float8.filter_fqns entry 'attention.wkv' names no "
     "linear of the model (e.g. 'layers.0.attention.wq'): a renamed layer would silently convert"),
    (1, [*F8, "--training.mixed_precision_param", "float16"], "float8 with training.mixed_precision_param float16 "
     "is refused: float8's scales and fp16's loss scale would fight over the same range; train float8 in bfloat16"),
    (2, [*F8, "--parallelism.context_parallel_degree", "2"], "float8 under context parallelism is refused: each rank "
     "would scale its share of a sequence by that share's own max, not the sequence's; use TP, FSDP or PP with "
     "float8"),
    (4, [*F8, "--parallelism.tensor_parallel_degree", "2", "--float8.enable_fsdp_float8_all_gather"],
     "float8.enable_fsdp_float8_all_gather under tensor parallelism needs "
     "float8.precompute_float8_dynamic_scale_for_fsdp: torchao's per-weight scale takes the max over the FSDP "
     "shards only, so each TP shard of a weight would get a scale of its own"),
])
def test_refused_configurations_are_one_line_from_check(error_line, world, overrides, line):
    assert error_line(world, overrides) == f"error: {line}"


def test_without_torchao_float8_is_one_line(error_line, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a))
    assert error_line(1, list(F8)) == ("error: float8.enable_float8_linear needs torchao: pip install torchao "
                                       "(requirements-dev.txt has it)")


@pytest.mark.parametrize("world, overrides, warning", [
    (4, ["--float8.enable_fsdp_float8_all_gather", "--float8.emulate"],
     "float8.enable_float8_linear is off: float8.enable_fsdp_float8_all_gather, float8.emulate ignored"),
    (2, [*F8, "--parallelism.tensor_parallel_degree", "2", "--float8.enable_fsdp_float8_all_gather",
         "--float8.precompute_float8_dynamic_scale_for_fsdp"],
     "no FSDP in this layout: float8.enable_fsdp_float8_all_gather ignored; no float8 all-gather: "
     "float8.precompute_float8_dynamic_scale_for_fsdp ignored"),
    (4, [*F8, "--float8.precompute_float8_dynamic_scale_for_fsdp"],
     "no float8 all-gather: float8.precompute_float8_dynamic_scale_for_fsdp ignored"),
])
def test_float8_options_a_run_ignores_are_warned(caplog, world, overrides, warning):
    cfg = load_config(overrides)
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        warn_ignored_options(cfg, ParallelDims.from_config(cfg.parallelism, world))
    assert [r.getMessage() for r in caplog.records] == [warning]


def test_a_tensor_parallel_run_without_float8_needs_no_torchao():
    """torchao is optional: the TP plan asks each block for float8 styles, which must not import it."""
    code = ("import sys; sys.modules['torchao'] = None  # as if not installed\n"
            "from torchtitan_lite.models.common.decoder import TransformerBlock\n"
            "from torchtitan_lite.models.llama3.model import FLAVORS\n"
            "from torchtitan_lite.quantization import float8\n"
            "assert float8.tp_styles(TransformerBlock(0, FLAVORS['debugmodel'].with_(vocab_size=64))) is None")
    subprocess.run([sys.executable, "-c", code], check=True)
