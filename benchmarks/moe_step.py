"""The mixture-of-experts layer's costs and its two implementations, on whatever device there is.

    python benchmarks/moe_step.py [--out FILE.json]

- exact: torch._grouped_mm against the per-expert loop on the same token slots (outputs and every gradient, bitwise
  or how far apart), in each dtype grouped_mm takes on the device, and whether it takes fp32 there;
- time: one MoE layer's forward + backward, grouped GEMM against the loop, beside a dense SwiGLU feed-forward with
  the routed experts' active parameters (k x hidden), at Mixtral 8x7B's shape and at a fine-grained one (64 experts,
  top-6, DeepSeek-V2-Lite's), with the host syncs each makes (on a GPU); on a CPU the same at small shapes;
- compile: the layer under torch.compile (grouped GEMM, fullgraph) over steps whose routing differs: how many graphs
  it compiled after the second step (0 expected) and its time;
- compile_ep: the layer under expert parallelism (a group of one rank: the dispatch runs, to itself), compiled around
  the dispatch as training compiles it, against eager: graphs after each step, bits, time; tests/test_moe_kernels.py
  runs it on the CPU;
- empty_experts: experts no slot reached, through torch._grouped_mm alone and through our guard (moe.grouped): the
  weight gradient the kernel writes for them (Blackwell's is not zero: pytorch/pytorch#172439) and ours (zero), and
  the other experts' bits unchanged; tests/test_moe_kernels.py runs it on the CPU;
- mxfp8: the layer in bf16 against the same layer with its routed experts in MXFP8 (quantization/mxfp8_experts.py:
  torchao's kernels on SM100, its emulation elsewhere, which is no speed test): forward + backward time and each
  output's and gradient's distance from bf16's; tests/test_moe_kernels.py runs it on the CPU. gpu_check adds the
  debug MoE model's bf16 curve against MXFP8 experts' (mxfp8_curve): the loss gap and tokens/s.
benchmarks/gpu_paths.py's `moe` check runs this and the debug MoE model's curve on the GPU against the CPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import time
import warnings
from pathlib import Path

import torch

from torchtitan_lite.models.common import moe
from torchtitan_lite.models.common.layers import FeedForward

SHAPES = {"mixtral_8x7b": dict(dim=4096, hidden=14336, num_experts=8, top_k=2),
          "fine_grained": dict(dim=2048, hidden=1408, num_experts=64, top_k=6)}
CPU_SHAPES = {"small": dict(dim=256, hidden=512, num_experts=8, top_k=2),
              "small_fine": dict(dim=256, hidden=128, num_experts=32, top_k=4)}


@contextlib.contextmanager
def implementation(name: str):
    """Every GroupedExperts call in this block takes `name` ("grouped" or "looped")."""
    fits = moe.grouped_mm_fits
    moe.grouped_mm_fits = lambda x, w: name == "grouped"
    try:
        yield
    finally:
        moe.grouped_mm_fits = fits


def layer(shape: dict, dtype: torch.dtype, device: str, seed: int = 0) -> moe.MoE:
    torch.manual_seed(seed)
    args = moe.MoEArgs(num_experts=shape["num_experts"], top_k=shape["top_k"])
    m = moe.MoE(shape["dim"], shape["hidden"], args).to(device)
    m.init_weights(lambda p, std: torch.nn.init.trunc_normal_(p, std=std), 0.02)
    return m.to(dtype)


def fwd_bwd(m: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    x = x.detach().requires_grad_()
    y = m(x)
    y.backward(torch.ones_like(y) / y.numel() ** 0.5)
    grads = {"x": x.grad, **{n: p.grad for n, p in m.named_parameters()}}
    m.zero_grad(set_to_none=True)
    return y.detach(), grads


def exact(device: str) -> dict:
    out = {}
    dtypes = [torch.float32, torch.bfloat16]
    for dtype in dtypes:
        m = layer(dict(dim=256, hidden=512, num_experts=8, top_k=2), dtype, device)
        x = torch.randn(4096, 256, device=device, dtype=dtype)
        try:
            with implementation("grouped"):
                yg, gg = fwd_bwd(m, x)
        except Exception as e:  # noqa: BLE001 - a report: whether grouped_mm takes this dtype here
            out[str(dtype)] = {"grouped_mm": f"refused: {type(e).__name__}: {str(e)[:200]}"}
            continue
        with implementation("looped"):
            yl, gl = fwd_bwd(m, x)
        diffs = {n: (gg[n].float() - gl[n].float()).abs().max().item() for n in gg}
        out[str(dtype)] = {"grouped_mm_fits says": moe.grouped_mm_fits(x, m.experts.w1),
                           "output bitwise": torch.equal(yg, yl),
                           "max |output diff|": (yg.float() - yl.float()).abs().max().item(),
                           "gradients bitwise": f"{sum(torch.equal(gg[n], gl[n]) for n in gg)} of {len(gg)}",
                           "max |grad diff|": max(diffs.values())}
    return out


def empty_experts(device: str, dtype: torch.dtype = torch.float32) -> dict:
    """Weight gradients of experts that received no slot, from the kernel alone and through moe.grouped's guard."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([40, 0, 24, 0, 0, 64, 8, 0], device=device)  # experts 1, 3, 4, 7 empty
    x = torch.randn(int(counts.sum()), 64, generator=gen).to(device, dtype)
    w = torch.randn(8, 128, 64, generator=gen).to(device, dtype)
    out_grad = torch.randn(len(x), 128, generator=gen).to(device, dtype)  # a real one: sum()'s has zero strides
    grads = {}
    for name, mm in (("kernel", lambda w: torch._grouped_mm(x, w.transpose(-2, -1), offs=counts.cumsum(0).to(
            torch.int32))), ("guarded", lambda w: moe.grouped(x, w, counts))):
        weight = w.clone().requires_grad_()
        mm(weight).backward(out_grad)
        grads[name] = weight.grad
    empty, used = counts == 0, counts > 0
    return {"device": torch.cuda.get_device_name() if device == "cuda" else device, "dtype": str(dtype),
            "kernel's max |grad| of empty experts": grads["kernel"][empty].abs().max().item(),
            "guarded max |grad| of empty experts": grads["guarded"][empty].abs().max().item(),
            "used experts' grads bitwise": torch.equal(grads["kernel"][used], grads["guarded"][used])}


def mxfp8(shape: dict, device: str, tokens: int, repeats: int) -> dict:
    """One bf16 layer's forward + backward, its routed experts by torch._grouped_mm against MXFP8's, and how far
    MXFP8's output and gradients are from bf16's (SQNR, dB: 20 log10 |ref| / |ref - mxfp8|)."""
    from torchtitan_lite.config import load_config  # noqa: PLC0415 - torchao's import: this measure only
    from torchtitan_lite.quantization import mxfp8_experts  # noqa: PLC0415

    emulate = [] if mxfp8_experts.has_mxfp8_grouped_mm() else ["--float8.emulate"]
    m = layer(shape, torch.bfloat16, device)
    q = copy.deepcopy(m)
    mxfp8_experts.convert(q, load_config(["--float8.moe_fqns", "experts", *emulate]))
    x = torch.randn(tokens, shape["dim"], device=device, dtype=torch.bfloat16)
    with implementation("grouped"):  # the converted experts take torchao's matmul whatever this says
        (y, grads), (yq, grads_q) = fwd_bwd(m, x), fwd_bwd(q, x)
        out = {"kernels": "torchao's emulation" if emulate else "torchao's SM100 kernels",
               "bf16 ms": _ms(lambda: fwd_bwd(m, x), repeats), "mxfp8 ms": _ms(lambda: fwd_bwd(q, x), repeats)}
    out["speed-up"] = round(out["bf16 ms"] / out["mxfp8 ms"], 3)
    out["SQNR dB against bf16"] = {"output": _sqnr(y, yq), **{n: _sqnr(grads[n], grads_q[n]) for n in grads}}
    return out


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    return round((20 * torch.log10(ref.float().norm() / (ref.float() - got.float()).norm())).item(), 1)


def mxfp8_curve(run, steps: int = 20) -> dict:
    """The debug MoE model in bf16 through train.run (`run`: gpu_paths.run), its routed experts in bf16 and in MXFP8:
    the largest loss gap, and the median tokens/s of each after the first 3 steps."""
    from torchtitan_lite.quantization import mxfp8_experts  # noqa: PLC0415

    args = ("--model.flavor", "debugmodel_moe", "--training.mixed_precision_param", "bfloat16")
    emulate = ("--float8.emulate",) * (not mxfp8_experts.has_mxfp8_grouped_mm())
    bf16, mx = run(*args, steps=steps), run(*args, "--float8.moe_fqns", "experts", *emulate, steps=steps)
    tps = lambda recs: sorted(r["tps"] for r in recs[3:])[len(recs[3:]) // 2]  # noqa: E731
    return {"emulated": bool(emulate), "max |loss - bf16|": max(abs(a["loss"] - b["loss"]) for a, b in zip(mx, bf16)),
            "max relative loss gap": max(abs(a["loss"] / b["loss"] - 1) for a, b in zip(mx, bf16)),
            f"loss at {steps}": mx[-1]["loss"], "bf16 loss": bf16[-1]["loss"], "tokens/s": tps(mx),
            "bf16 tokens/s": tps(bf16)}


def _syncs(fn) -> int:
    if not torch.cuda.is_available():
        return -1
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _ms(fn, repeats: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[len(times) // 2] * 1e3, 3)


def timed(shape: dict, dtype: torch.dtype, device: str, tokens: int, repeats: int) -> dict:
    m = layer(shape, dtype, device)
    x = torch.randn(tokens, shape["dim"], device=device, dtype=dtype)
    out = {}
    for name in ("grouped", "looped"):
        with implementation(name):
            try:
                out[f"{name} ms"] = _ms(lambda: fwd_bwd(m, x), repeats)
                out[f"{name} syncs"] = _syncs(lambda: fwd_bwd(m, x))
            except Exception as e:  # noqa: BLE001 - a report
                out[f"{name} ms"] = f"{type(e).__name__}: {str(e)[:200]}"
    torch.manual_seed(0)
    dense = FeedForward(shape["dim"], shape["top_k"] * shape["hidden"]).to(device, dtype)
    out["dense, same active parameters, ms"] = _ms(lambda: fwd_bwd(dense, x), repeats)
    flops = 6 * tokens * 3 * shape["dim"] * shape["hidden"] * shape["top_k"]  # the routed experts' matmuls
    if isinstance(out.get("grouped ms"), float):
        out["grouped TFLOP/s (experts' matmuls)"] = round(flops / out["grouped ms"] / 1e9, 1)
    del m, dense, x
    return out


def compiled(shape: dict, dtype: torch.dtype, device: str, tokens: int, steps: int = 6) -> dict:
    from torch._dynamo.utils import counters  # noqa: PLC0415 - compile's own bookkeeping

    torch._dynamo.reset()
    counters.clear()
    m = layer(shape, dtype, device)
    c = torch.compile(m, fullgraph=True)
    graphs, times = [], []
    with implementation("grouped"):
        for step in range(steps):
            x = torch.randn(tokens, shape["dim"], device=device, dtype=dtype, generator=torch.Generator(device)
                            .manual_seed(step))  # a different routing every step
            t0 = time.perf_counter()
            fwd_bwd(c, x)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            graphs.append(counters["stats"]["unique_graphs"])
        eager = _ms(lambda: fwd_bwd(m, x), 5)
        fast = _ms(lambda: fwd_bwd(c, x), 5)
    return {"graphs after each step": graphs, "graphs compiled after step 2": graphs[-1] - graphs[1],
            "first step s": round(times[0], 1), "compiled ms": fast, "eager ms": eager,
            "graph breaks": sum(counters["graph_break"].values())}


def compiled_ep(shape: dict, device: str, tokens: int, backend: str = "inductor", steps: int = 4) -> dict:
    """The bf16 layer under expert parallelism on a group of one rank (the dispatch whole: the counts' exchange, the
    split sizes read on the host, the slots' all-to-alls, to itself), its experts' grouped GEMM compiled as
    parallel/compile.py compiles it under EP, against the same layer eager, over steps whose routing differs: the
    graphs after each step (none after the first), each step's bits (equal under aot_eager, whose graphs run eager's
    ops), and the time of each. An ep degree above 1 needs a process a rank; gpu_paths.py runs one."""
    import torch.distributed as dist  # noqa: PLC0415 - this measure's group only
    from torch._dynamo.utils import counters  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    from torchtitan_lite.parallel.compile import compiled_experts  # noqa: PLC0415
    from torchtitan_lite.parallel.expert_parallel import apply_ep  # noqa: PLC0415

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch._dynamo.reset()
        counters.clear()
        mesh, eager, ep = init_device_mesh(device, (1,)), *(layer(shape, torch.bfloat16, device) for _ in range(2))
        apply_ep(eager, mesh)
        apply_ep(ep, mesh, compiled_experts(backend))
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        graphs, bitwise, worst = [], [], 0.0
        for step in range(steps):
            x = torch.randn(tokens, shape["dim"], device=device, dtype=torch.bfloat16,
                            generator=torch.Generator(device).manual_seed(step))  # a different routing every step
            (y, grads), (yc, grads_c) = fwd_bwd(eager, x), fwd_bwd(ep, x)
            graphs.append(counters["stats"]["unique_graphs"])
            bitwise.append(torch.equal(y, yc) and all(torch.equal(local(grads[n]), local(grads_c[n])) for n in grads))
            worst = max(worst, (y.float() - yc.float()).abs().max().item())
        return {"backend": backend, "graphs after each step": graphs, "graphs compiled after step 1":
                graphs[-1] - graphs[0], "bitwise at each step": bitwise, "max |output diff|": worst,
                "graph breaks": sum(counters["graph_break"].values()), "eager ms": _ms(lambda: fwd_bwd(eager, x), 5),
                "compiled ms": _ms(lambda: fwd_bwd(ep, x), 5)}
    finally:
        if made:
            dist.destroy_process_group()


def curve_against_cpu(run, steps: int = 20) -> dict:
    """The debug MoE model trained by train.run here (`run`: gpu_paths.run) against the same run on this machine's
    CPU (a process that sees no GPU), fp32."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from torchtitan_lite.runtime.run_history import read_metrics  # noqa: PLC0415

    root = Path(__file__).resolve().parents[1]
    args = ["--model.flavor", "debugmodel_moe", "--training.steps", str(steps)]
    here = run(*args[:2], steps=steps)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(root / "train.py"), "--job.config_file", str(root / "tests/assets/tiny.toml"),
                        "--job.dump_folder", tmp, *args], check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                       stdout=subprocess.DEVNULL)
        cpu = read_metrics(tmp)
    return {"max |loss - CPU|": max(abs(a["loss"] - b["loss"]) for a, b in zip(here, cpu)),
            "step 1 grad_norm rel diff": abs(here[0]["grad_norm"] / cpu[0]["grad_norm"] - 1),
            f"loss at {steps}": here[-1]["loss"], "CPU loss": cpu[-1]["loss"]}


def trainer_precisions(run, steps: int = 20) -> dict:
    """The debug MoE model through train.run in bf16 (autocast; FSDP2's bf16 parameters on a one-rank mesh) and
    compiled, against fp32: the loss gap, the grad norm's, and compile's graphs and breaks."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    from torchtitan_lite.parallel.dims import ParallelDims  # noqa: PLC0415

    moe_args, bf16 = ("--model.flavor", "debugmodel_moe"), ("--training.mixed_precision_param", "bfloat16")
    fsdp, out = ParallelDims.fsdp, {}
    fp32 = run(*moe_args, steps=steps)
    variants = {"bf16 autocast": (*moe_args, *bf16), "bf16 compiled": (*moe_args, *bf16, "--compile.enable"),
                "bf16 FSDP2": (*moe_args, *bf16)}
    for name, args in variants.items():
        ParallelDims.fsdp = property(lambda self: True) if "FSDP" in name else fsdp
        torch._dynamo.reset()
        counters.clear()
        try:
            recs = run(*args, steps=steps)
            out[name] = {"max |loss - fp32|": max(abs(a["loss"] - b["loss"]) for a, b in zip(recs, fp32)),
                         "step 1 |loss - fp32|": abs(recs[0]["loss"] - fp32[0]["loss"]),
                         "step 1 grad_norm rel diff": abs(recs[0]["grad_norm"] / fp32[0]["grad_norm"] - 1),
                         f"loss at {steps}": recs[-1]["loss"], "graphs": counters["stats"]["unique_graphs"],
                         "graph breaks": sum(counters["graph_break"].values())}
        except Exception as e:  # noqa: BLE001 - a report
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        finally:
            ParallelDims.fsdp = fsdp
    return out


def gpu_check(run, syncs) -> dict:
    """gpu_paths.py's moe check (`run`, `syncs`: its own): the debug MoE model's curve against the CPU's, its training
    steps' syncs, its precisions, then this script's figures."""
    out = {"curve": curve_against_cpu(run), "syncs": syncs("--model.flavor", "debugmodel_moe")}
    print(json.dumps(out), flush=True)
    return {**out, "precisions": trainer_precisions(run), "mxfp8 curve": mxfp8_curve(run), **main()}


def main(out_file: str | None = None) -> dict:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes, tokens, repeats = (SHAPES, 8192, 10) if cuda else (CPU_SHAPES, 1024, 5)
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
               "dtype": str(dtype), "tokens": tokens}
    for key, fn in [("exact", lambda: exact(device)),
                    *[(f"time {n}", lambda s=s: timed(s, dtype, device, tokens, repeats)) for n, s in shapes.items()],
                    ("compile", lambda: compiled(next(iter(shapes.values())), dtype, device, tokens)),
                    ("compile_ep", lambda: compiled_ep(next(iter(shapes.values())), device, tokens,
                                                       "inductor" if cuda else "aot_eager")),
                    ("mxfp8", lambda: mxfp8(next(iter(shapes.values())), device, tokens, repeats)),
                    ("empty_experts", lambda: empty_experts(device, dtype))]:
        try:
            results[key] = fn()
        except Exception as e:  # noqa: BLE001 - one broken measure must not hide the others
            results[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps({key: results[key]}), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    if out_file:
        Path(out_file).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="also write the results here, as JSON")
    main(p.parse_args().out)
