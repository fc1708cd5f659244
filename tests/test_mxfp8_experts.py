"""MXFP8 routed experts (quantization/mxfp8_experts.py): torchao's casts against the OCP MX format written as a plain
loop, its emulated grouped matmul against the same values multiplied in fp64, one MoE layer within MXFP8's tolerance
of its fp32 and bf16 twins, which experts convert, and the refusals. The layouts' parity is
tests/multiprocess/test_moe_layouts.py's (its moe_mxfp8 rows)."""

import copy
import dataclasses
import importlib.util
import logging
import math
import struct

import pytest
import torch

from torchtitan_lite.config import load_config
from torchtitan_lite.models.common.moe import GroupedExperts, MoEArgs
from torchtitan_lite.models import registry
from torchtitan_lite.models.deepseek_v3.model import FLAVORS as DEEPSEEK
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.parallelize import warn_ignored_options
from torchtitan_lite.quantization import mxfp8_experts
from tests.test_moe import layer

pytest.importorskip("torchao")  # an optional dependency, which requirements-dev.txt installs

MX = ("--float8.moe_fqns", "experts", "--float8.emulate")
BLOCK = 32


def e4m3(v: float) -> float:
    """OCP FP8 E4M3 (torch's float8_e4m3fn): 3 mantissa bits, exponents from -6 (below: subnormals, steps of 2**-9),
    round to nearest with ties to even (Python's round), saturating at 448 (torchao clamps before its cast)."""
    a = abs(v)
    if a == 0:
        return 0.0
    step = 2.0 ** (max(math.frexp(a)[1] - 1, -6) - 3)
    return math.copysign(min(round(a / step) * step, 448.0), v)


def block_exponent(block: list[float], mode: str) -> int:
    """The block's E8M0 scale exponent: the OCP MX spec's floor(log2 max|block|) - 8 (8: e4m3's largest exponent), or
    RCEIL's smallest power of two at least max|block| / 448 (that quotient rounded to fp32 first, as Blackwell's
    cvt.rp.satfinite.ue8m0 takes it); -127 for a block of zeros."""
    amax = max(abs(v) for v in block)
    if amax == 0:
        return -127
    if mode == "floor":
        exponent = math.frexp(amax)[1] - 1 - 8
    else:
        mantissa, exponent = math.frexp(struct.unpack("f", struct.pack("f", amax / 448))[0])
        exponent -= mantissa == 0.5  # an exact power of two is its own ceiling
    return max(-127, min(127, exponent))


def mx(rows: torch.Tensor, mode: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """(E8M0 exponents, e4m3 elements as floats) of `rows` (R, C), a scale a block of 32 along each row."""
    exponents, elements = [], []
    for row in rows.double().tolist():
        for start in range(0, len(row), BLOCK):
            block = row[start:start + BLOCK]
            exponents.append(e := block_exponent(block, mode))
            elements += [e4m3(math.ldexp(v, -e)) for v in block]
    return (torch.tensor(exponents).view(rows.shape[0], -1),
            torch.tensor(elements, dtype=torch.float64).view(rows.shape))


def dequantized(rows: torch.Tensor) -> torch.Tensor:
    """`rows` (R, C) through MXFP8 and back, in fp64: each element times its block's power of two."""
    exponents, elements = mx(rows)
    return elements * torch.exp2(exponents.double()).repeat_interleave(BLOCK, dim=1)


def wide_range(*shape: int, seed: int) -> torch.Tensor:
    """Normal values, each scaled by a power of two from 2**-20 to 2**4: every block has elements in e4m3's subnormal
    range, where the scale decides their rounding."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-20, 5, shape, generator=g).float())


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_torchaos_casts_are_the_ocp_mx_formats_written_as_a_plain_loop(mode):
    """torchao's to_mx (what the emulation and the training recipe's RCEIL scales run) against the loop above:
    every scale and every element, bitwise, on blocks of wide range, a block of zeros, a block whose max is exactly
    448 x a power of two, and ties between two e4m3 values (1.0625 lies between 1 and 1.125: ties to even, 1)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = wide_range(16, 96, seed=0)
    x[1, :BLOCK] = 0
    x[2, :BLOCK] = torch.tensor([448.0 * 2**-3, 1.0625 * 2**-3, 1.1875 * 2**-3, -1.0625 * 2**-3] * 8)
    scale, data = to_mx(x, torch.float8_e4m3fn, BLOCK, ScaleCalculationMode[mode.upper()])
    exponents, elements = mx(x, mode)
    assert torch.equal(scale.view(torch.uint8).long() - 127, exponents)
    assert torch.equal(data.double(), elements)
    assert elements[2, :4].tolist() == [448.0, 1.0, 1.25, -1.0] and (elements[1, :BLOCK] == 0).all()


def quantized_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor,
                         pad: bool = True):
    """(output, input gradient, weight gradient) of x @ w[e].T by expert group through mxfp8_experts.grouped_mm, fp32
    (`pad` False: without torchao's padding of each expert's slots to 32)."""
    config = mxfp8_experts.torchao_config(load_config(list(MX)))
    config = dataclasses.replace(config, pad_token_groups_for_grouped_mm=pad)
    mxfp8_experts._install_grouped_mm_out_dtype()
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = mxfp8_experts.grouped_mm(x, w, counts, config)
    y.backward(grad)
    return y, x.grad, w.grad


def test_the_emulated_grouped_mm_multiplies_the_mx_values_of_each_operand_along_its_inner_dim():
    """torchao's emulation against the loop's casts multiplied in fp64, group by group: the output from each slot's
    row (along dim) and each expert's weight rows; the input gradient from each output gradient row and each
    weight's columns (along its out dim); the weight gradient from blocks of 32 slots of one expert, its group padded
    with zeros to a multiple of 32 (an expert's blocks start at its first slot, whatever came before), along the
    slots. Agreement to fp32's sums, where one element cast otherwise would be ~1e-3 off."""
    counts = torch.tensor([5, 0, 40, 33])
    x, grad = wide_range(78, 64, seed=1), wide_range(78, 32, seed=2)
    w = wide_range(4, 32, 64, seed=3)
    y, x_grad, w_grad = quantized_grouped_mm(x, w, counts, grad)
    ends = counts.cumsum(0).tolist()
    want_y, want_x_grad, want_w_grad = torch.zeros(78, 32).double(), torch.zeros(78, 64).double(), []
    for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        rows = slice(start, end)
        if start == end:
            want_w_grad.append(torch.zeros(32, 64).double())
            continue
        want_y[rows] = dequantized(x[rows]) @ dequantized(w[e]).T
        want_x_grad[rows] = dequantized(grad[rows]) @ dequantized(w[e].T.contiguous()).T
        padded = -(end - start) // BLOCK * -BLOCK
        grad_t, x_t = torch.zeros(32, padded), torch.zeros(64, padded)
        grad_t[:, :end - start], x_t[:, :end - start] = grad[rows].T, x[rows].T
        want_w_grad.append(dequantized(grad_t) @ dequantized(x_t).T)
    for got, want in ((y, want_y), (x_grad, want_x_grad), (w_grad, torch.stack(want_w_grad))):
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(w_grad[1], torch.zeros_like(w_grad[1]))  # expert 1 had no slot


def sqnr(reference: torch.Tensor, other: torch.Tensor) -> float:
    return (20 * torch.log10(reference.norm() / (reference - other.to(reference.dtype)).norm())).item()


def test_one_grouped_mm_meets_torchaos_sqnr_thresholds():
    """Against fp32 on normal data: output >= 27 dB, input gradient >= 25, weight gradient >= 24 (torchao's test of
    its MXFP8 grouped matmul, forward and backward); below 35, so the casts are there."""
    g = torch.Generator().manual_seed(4)
    counts = torch.tensor([300, 0, 129, 595])
    x, w, grad = torch.randn(1024, 256, generator=g), torch.randn(4, 512, 256, generator=g), torch.randn(1024, 512,
                                                                                                        generator=g)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    yr = torch._grouped_mm(xr, wr.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))
    yr.backward(grad)
    got = quantized_grouped_mm(x, w, counts, grad)
    for want, have, threshold in zip((yr, xr.grad, wr.grad), got, (27, 25, 24)):
        assert threshold <= sqnr(want, have) < 35, (threshold, sqnr(want, have))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_moe_layer_in_mxfp8_stays_within_its_tolerance_of_its_twin(dtype):
    """A mixture (8 experts, top 2, dim 64, hidden 96) converted against its unconverted twin in the same dtype:
    output, input gradient and every parameter's gradient (router gate, w1, w2, w3) within 19 dB. Each of its matmuls
    meets torchao's thresholds (above: 24 dB at worst), and a layer's output and gradients pass through three of them
    whose roundings add their noise powers: 24 - 10 log10(3) = 19.2 dB. Measured 22.9 to 23.7 dB."""
    twin = layer(MoEArgs(), dim=64, hidden=96).to(dtype)
    converted = copy.deepcopy(twin)
    mxfp8_experts.convert(converted, load_config(list(MX)))
    x = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    results = []
    for m in (twin, converted):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(grad)
        results.append({"output": y, "input": xi.grad, **{n: p.grad for n, p in m.named_parameters()}})
    assert set(results[0]) == {"output", "input", "router.gate.weight", "experts.w1", "experts.w2", "experts.w3"}
    for name, want in results[0].items():
        assert 19 <= sqnr(want.double(), results[1][name]) < 35, (name, sqnr(want.double(), results[1][name]))


def test_the_weight_gradients_blocks_are_the_slots_an_expert_computes_together():
    """Why a layout must keep them (mxfp8_experts.py): an expert's weight gradient scales blocks of 32 of its slots,
    so which slots it computes together decides the numbers, beyond any order of sums. Rank 0's 16 slots of an expert
    are tiny (2**-20), rank 1's large with zero output gradients: computed apart (each rank its own, as without EP),
    the tiny slots keep their precision; together (one process, or EP's regroup of both ranks' slots) they share
    blocks with the large ones and round to their scale. And torchao's padding keeps each expert's blocks its own:
    without it, an expert of tiny slots after one of large slots loses them alike."""
    g = torch.Generator().manual_seed(7)
    w, tiny, large = torch.randn(2, 32, 64, generator=g), torch.randn(16, 64, generator=g) * 2**-20, torch.randn(
        16, 64, generator=g)
    grad = torch.randn(16, 32, generator=g)
    exact = grad.double().T @ tiny.double()
    apart = quantized_grouped_mm(tiny, w, torch.tensor([0, 16]), grad)[2][1]
    together = quantized_grouped_mm(torch.cat([tiny, large]), w, torch.tensor([0, 32]),
                                    torch.cat([grad, torch.zeros_like(grad)]))[2][1]
    assert sqnr(exact, apart) >= 24 and sqnr(exact, together) < 3, (sqnr(exact, apart), sqnr(exact, together))
    after_large = [quantized_grouped_mm(torch.cat([large, tiny]), w, torch.tensor([16, 16]), torch.cat([grad, grad]),
                                        pad=pad)[2][1] for pad in (True, False)]
    assert sqnr(exact, after_large[0]) >= 24 and sqnr(exact, after_large[1]) < 3, [sqnr(exact, a) for a in after_large]


def test_empty_experts_and_a_rank_with_no_slots_get_zero_weight_gradients():
    w = torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(10))
    for counts in (torch.tensor([0, 7, 0]), torch.tensor([0, 0, 0])):
        m = int(counts.sum())
        y, x_grad, w_grad = quantized_grouped_mm(torch.randn(m, 64), w, counts, torch.randn(m, 32))
        assert y.shape == (m, 32) and x_grad.shape == (m, 64)
        assert torch.equal(w_grad[counts == 0], torch.zeros_like(w_grad[counts == 0]))


def test_the_routed_experts_convert_and_their_parameters_stay_plain_tensors():
    """torchtitan's rule, a name containing an entry: every mixture's routed experts for "experts", DeepSeek-V3's
    shared expert never (a dense feed-forward, float8.enable_float8_linear's). The parameters, and so checkpoints,
    are the unconverted model's."""
    cfg = load_config(list(MX))
    with torch.device("meta"):
        llama = Transformer(FLAVORS["tiny_moe"].with_(vocab_size=64))
        deepseek = registry.get("deepseek_v3").model_class(DEEPSEEK["debugmodel"].with_(vocab_size=64))
        plain = {n: type(p) for n, p in deepseek.named_parameters()}
    mxfp8_experts.convert(llama, cfg)
    mxfp8_experts.convert(deepseek, cfg)
    assert [n for n, m in llama.named_modules() if m.__dict__.get("grouped_mm")] == ["layers.0.moe.experts",
                                                                                     "layers.1.moe.experts"]
    routed = [n for n, m in deepseek.named_modules() if isinstance(m, GroupedExperts)]
    assert [n for n, m in deepseek.named_modules() if m.__dict__.get("grouped_mm")] == routed
    assert "layers.1.moe.experts" in routed and any("shared_experts" in n for n, _ in deepseek.named_modules())
    assert {n: type(p) for n, p in deepseek.named_parameters()} == plain
    assert mxfp8_experts.converted_names(llama, ["layers.1."]) == ["layers.1.moe.experts"]


@pytest.mark.parametrize("world, overrides, line", [
    (1, ["--model.flavor", "tiny", *MX], "float8.moe_fqns converts a mixture's routed experts, and model.flavor tiny "
     "has none: drop float8.moe_fqns, or set moe.num_experts"),
    (1, ["--float8.moe_fqns", "experts,feed_forward", "--float8.emulate"], "float8.moe_fqns entry 'feed_forward' "
     "names no routed experts of the model (e.g. 'layers.0.moe.experts'): a renamed layer would silently stay in "
     "high precision"),
    (1, [*MX, "--moe.hidden", "48"], "MXFP8 scales blocks of 32 elements along each matmul's inner dim, so the "
     "experts' dim and hidden must be multiples of 32 (layers.0.moe.experts: dim 256, hidden 48): set moe.hidden to "
     "one, or drop float8.moe_fqns"),
    (1, [*MX, "--training.mixed_precision_param", "float16"], "float8.moe_fqns with training.mixed_precision_param "
     "float16 is refused: MXFP8's scales and fp16's loss scale would fight over the same range; train MXFP8 in "
     "bfloat16"),
    *[(2, [*MX, f"--parallelism.{kind}_parallel_degree", "2"], "float8.moe_recipe_name mxfp8 under tensor or context "
       "parallelism is refused: its weight gradients scale blocks of 32 of an expert's slots, and there each rank "
       "routes part of every sequence, so the blocks would hold other slots than one process's: use "
       "mxfp8_wgrad_with_hp (weight gradients in high precision), or TP and CP 1") for kind in ("tensor", "context")],
    (1, [*MX, "--compile.enable", "--training.mixed_precision_param", "bfloat16", "--moe.aux_loss_coeff", "0"],
     "float8.moe_fqns trains eager so far (torchao pads each expert's slots to 32 by sizes its emulation reads on the "
     "host, which compile cannot trace, and compiled MXFP8 experts are untested): drop compile.enable"),
    (1, ["--float8.moe_fqns", "experts"], "MXFP8 grouped matmuls need an NVIDIA GPU of compute capability 10.x (B200, "
     "GB200) and torchao's CUDA build, and this machine has neither: set float8.emulate for the numerics alone"),
])
def test_refused_configurations_are_one_line_from_check(error_line, world, overrides, line):
    assert error_line(world, ["--model.flavor", "tiny_moe", *overrides]) == f"error: {line}"


def test_the_high_precision_weight_gradients_pass_under_tensor_and_context_parallelism(monkeypatch, capsys, tmp_path):
    import train  # noqa: PLC0415

    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = ["--job.config_file", "tests/assets/tiny.toml", "--job.dump_folder", str(tmp_path), "--model.flavor",
            "tiny_moe", *MX, "--float8.moe_recipe_name", "mxfp8_wgrad_with_hp", "--parallelism.tensor_parallel_degree",
            "2", "--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"]
    assert train.run(argv, check=True) == 0, capsys.readouterr().err
    assert "mxfp8_wgrad_with_hp routed experts (emulated)" in capsys.readouterr().out


def test_without_torchao_the_experts_mxfp8_is_one_line(error_line, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a))
    assert error_line(1, ["--model.flavor", "tiny_moe", *MX]) == ("error: float8.moe_fqns needs torchao: pip install "
                                                                  "torchao (requirements-dev.txt has it)")


@pytest.mark.parametrize("overrides, warnings", [
    (["--float8.moe_recipe_name", "mxfp8_wgrad_with_hp"], ["float8.moe_fqns is empty: float8.moe_recipe_name "
                                                           "ignored"]),
    ([*MX, "--float8.moe_recipe_name", "mxfp8_wgrad_with_hp"], []),  # emulate serves the experts: not ignored
    ([*MX, "--float8.recipe_name", "rowwise"], ["float8.enable_float8_linear is off: float8.recipe_name ignored"]),
])
def test_experts_options_a_run_ignores_are_warned(caplog, overrides, warnings):
    cfg = load_config(overrides)
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        warn_ignored_options(cfg, ParallelDims.from_config(cfg.parallelism, 1))
    assert [r.getMessage() for r in caplog.records] == warnings
