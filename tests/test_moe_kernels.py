"""How a mixture of experts' kernels compute (models/common/moe.py): the router's gate in fp32 under autocast and
FSDP's bf16, grouped GEMM only where its one-kernel path exists, empty experts' gradients zero whatever the
kernel writes, and the GPU check's measure of it on the CPU (tests/test_moe.py: the layer itself)."""

import pytest
import torch

from torchtitan_lite.models.common import moe
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
from torchtitan_lite.models.common.moe import MoE, MoEArgs
from tests.test_moe import layer


def test_under_bf16_autocast_the_routers_logits_are_the_fp32_computations_bitwise():
    """Autocast would run the gate's matmul in bf16, rounding scores into ties at the top-k boundary: moe.gate_logits
    turns it off, from fp32 tokens and from bf16 ones (autocast leaves either kind in the residual stream)."""
    router = layer(MoEArgs(num_experts=64, top_k=6)).router
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(11))
    for tokens in (x, x.bfloat16()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = router(tokens)[3]
        assert torch.equal(logits, torch.nn.functional.linear(tokens.float(), router.gate.weight))


def test_under_fsdp_in_bf16_the_gate_computes_from_its_fp32_master_weight():
    """FSDP's bf16 policy casts a block's parameters as it gathers them: parallelize.fp32_gates makes each router gate
    a unit of its own that gathers in fp32, so the gate's matmul reads the master weight (one process, a real FSDP);
    an fp32 run keeps its units as they were, and compiled blocks, whose one graph cannot call FSDP's hooks, upcast the
    block's bf16 cast instead (test_the_router_scores_in_fp32_and_orders_each_tokens_experts_by_score)."""
    import torch.distributed as dist  # noqa: PLC0415 - only these tests make a process group
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy  # noqa: PLC0415

    from torchtitan_lite.config import JobConfig  # noqa: PLC0415
    from torchtitan_lite.parallel.parallelize import apply_fsdp, fp32_gate_policy  # noqa: PLC0415

    assert fp32_gate_policy(MixedPrecisionPolicy(torch.bfloat16), compiled=True) is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        models = {}
        for dtype in ("bfloat16", "float32"):
            cfg = JobConfig()
            cfg.training.mixed_precision_param = dtype
            models[dtype] = Transformer(FLAVORS["tiny_moe"].with_(vocab_size=64, max_seq_len=16))
            models[dtype].init_weights()
            apply_fsdp(models[dtype], init_device_mesh("cpu", (1,)), cfg)
        assert not any(isinstance(m.router.gate, FSDPModule) for m in models["float32"].modules() if isinstance(m, MoE))
        model, seen = models["bfloat16"], []
        gates = [m.router.gate for m in model.modules() if isinstance(m, MoE)]
        assert len(gates) == 2
        for gate in gates:
            assert gate._get_fsdp_state()._mp_policy.param_dtype == torch.float32
            gate.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.dtype))  # after FSDP's gather
            gate.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0], out)))
        assert model.layers["0"]._get_fsdp_state()._mp_policy.param_dtype == torch.bfloat16
        model(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(12)))
        assert seen[0::2] == [torch.float32] * 2
        for gate, x, logits in seen[1::2]:
            gate.reshard()
            master = gate.weight.to_local()  # the sharded fp32 parameter, whole on one rank
            assert master.dtype == torch.float32 and x.dtype == torch.float32
            assert torch.equal(logits, torch.nn.functional.linear(x, master))
    finally:
        dist.destroy_process_group()


def test_experts_no_slot_reached_get_exactly_zero_weight_gradients_whatever_the_kernel_writes(monkeypatch):
    """Blackwell's grouped GEMM writes non-zero weight gradients for empty groups (pytorch/pytorch#172439). A stand-in
    for torch._grouped_mm computes the real op and writes garbage (7, and a NaN) into the empty groups' weight gradient:
    those experts get exact zeros in w1, w2 and w3, every other number the unguarded real op's bits."""
    real = torch._grouped_mm

    class Garbage(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, offs):
            ctx.save_for_backward(a, b, offs)
            return real(a, b, offs=offs)

        @staticmethod
        def backward(ctx, grad):
            a, b, offs = ctx.saved_tensors
            with torch.enable_grad():
                a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
                grad_a, grad_b = torch.autograd.grad(real(a, b, offs=offs), (a, b), grad)
            empty = (offs.diff(prepend=offs.new_zeros(1)) == 0).nonzero().flatten()
            grad_b = grad_b.index_fill(0, empty, 7.0).index_fill(0, empty[:1], float("nan"))
            return grad_a, grad_b, None

    m = layer(MoEArgs())
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(13))
    counts, empty = torch.tensor([9, 0, 14, 3, 1, 6, 0, 7]), [1, 6]
    assert moe.grouped_mm_fits(x, m.experts.w1)

    def step(kernel, unguarded: bool):
        monkeypatch.setattr(torch, "_grouped_mm", kernel)
        if unguarded:
            monkeypatch.setattr(moe, "grouped", lambda x, w, c: kernel(x, w.transpose(-2, -1),
                                                                       offs=c.cumsum(0).to(torch.int32)))
        xi = x.clone().requires_grad_()
        m.zero_grad()
        y = m.experts(xi, counts)
        y.backward(torch.arange(y.numel(), dtype=y.dtype).view_as(y).sin())
        monkeypatch.undo()
        return [y, xi.grad, *(p.grad for p in m.experts.parameters())]

    reference = step(real, unguarded=True)
    assert step(Garbage.apply, unguarded=True)[2][empty].isnan().any()  # the stand-in does write garbage
    guarded = step(Garbage.apply, unguarded=False)
    for got, want in zip(guarded, reference):
        assert torch.equal(got, want)
    for grad in guarded[2:]:
        assert torch.equal(grad[empty], torch.zeros_like(grad[empty])) and grad[empty].signbit().sum() == 0


@pytest.mark.parametrize("device, capability, kernel", [
    ("cpu", None, "grouped"), ("cuda", (9, 0), "grouped"), ("cuda", (10, 0), "grouped"), ("cuda", (10, 3), "grouped"),
    ("cuda", (8, 0), "looped"), ("cuda", (8, 9), "looped"), ("cuda", (12, 0), "looped"), ("cuda", None, "looped")])
def test_bf16_takes_grouped_gemm_only_where_its_one_kernel_exists(monkeypatch, device, capability, kernel):
    """torch 2.13's bf16 grouped GEMM is one kernel on the CPU and on CUDA's SM90 and SM100; elsewhere its fallback
    reads the offsets on the host (9 syncs a layer to the loop's 3), so the layer takes the loop. The decision is made
    on the CPU as on a device of that kind (moe.device_kind, the one query of the device, stands in for it); compile,
    which cannot trace the loop, keeps the grouped GEMM."""
    m, used = layer(MoEArgs()).bfloat16(), []
    monkeypatch.setattr(moe, "device_kind", lambda _: (device, capability))
    for name in ("grouped", "looped"):
        monkeypatch.setattr(moe, name, lambda *a, f=getattr(moe, name), name=name: used.append(name) or f(*a))
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(14)).bfloat16()
    m(x)
    assert set(used) == {kernel}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert moe.grouped_mm_fits(x, m.experts.w1)


def test_the_gpu_checks_empty_experts_measure_runs_on_the_cpu_through_the_same_code():
    """benchmarks/moe_step.py's empty_experts (what gpu_paths.py's moe check reports on a GPU: the kernel's weight
    gradient for experts no slot reached, and ours) on the CPU: the guard's zero, the used experts' bits kept."""
    import moe_step  # noqa: PLC0415 - benchmarks/, on pytest's path

    got = moe_step.empty_experts("cpu")
    assert got["guarded max |grad| of empty experts"] == 0.0 and got["used experts' grads bitwise"]


def test_the_gpu_checks_mxfp8_measure_runs_on_the_cpu_through_the_same_code():
    """benchmarks/moe_step.py's mxfp8 (gpu_paths.py's moe check on a GPU: bf16 experts against MXFP8 ones, time and
    distance) on the CPU, by torchao's emulation: both timed, every output and gradient within 19 dB of bf16's (the
    layer's bound, tests/test_mxfp8_experts.py) and not bf16's own. Its loss gap's arithmetic on stand-in runs."""
    pytest.importorskip("torchao")
    import moe_step  # noqa: PLC0415 - benchmarks/, on pytest's path

    got = moe_step.mxfp8(moe_step.CPU_SHAPES["small"], "cpu", tokens=128, repeats=1)
    assert got["kernels"] == "torchao's emulation" and got["bf16 ms"] > 0 and got["mxfp8 ms"] > 0
    assert set(got["SQNR dB against bf16"]) == {"output", "x", "router.gate.weight", "experts.w1", "experts.w2",
                                                "experts.w3"}
    assert all(19 <= db < 35 for db in got["SQNR dB against bf16"].values()), got

    def run(*args, steps):
        mx = "--float8.moe_fqns" in args
        return [{"loss": 2.0 + (0.004 if mx else 0) - s / 10, "tps": 90.0 if mx else 100.0} for s in range(steps)]

    curve = moe_step.mxfp8_curve(run, steps=6)
    assert curve["emulated"] and curve["max |loss - bf16|"] == pytest.approx(0.004)
    assert curve["tokens/s"] == 90.0 and curve["bf16 tokens/s"] == 100.0


def test_the_gpu_checks_compiled_expert_parallel_measure_runs_on_the_cpu_through_the_same_code():
    """benchmarks/moe_step.py's compile_ep (gpu_paths.py's moe check on a GPU, by inductor) on the CPU by aot_eager:
    the layer under expert parallelism on a one-rank group, its experts compiled as training compiles them under EP,
    gives eager's bits at every step of a different routing and compiles nothing after the first."""
    import moe_step  # noqa: PLC0415 - benchmarks/, on pytest's path

    got = moe_step.compiled_ep(moe_step.CPU_SHAPES["small"], "cpu", tokens=256, backend="aot_eager", steps=3)
    assert got["graphs after each step"][0] == 1 and got["graphs compiled after step 1"] == 0, got
    assert got["bitwise at each step"] == [True] * 3 and got["graph breaks"] == 0, got
