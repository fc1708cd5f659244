"""The paths a CPU cannot take, run on one GPU: what a session lent a GPU checks in one command.

    python benchmarks/gpu_paths.py [--only NAME ...] [--out FILE.json]

Each check is a real train.run (one process; a one-rank mesh) or the model's own step, on cuda:
- reference: the debug model's fp32 curve (tests/assets/tiny.toml, 50 steps) against the committed CPU curve;
- init: the layout-invariant init on the GPU against the CPU's, bit for bit (the debug model's init_weights, and an
  FSDP 1/8 row shard of an 8B FFN matrix), and its time against `normal_` on the GPU;
- bf16, fp16: the same run under autocast (fp16 with loss scaling): the gap to fp32, the loss scale, skipped steps;
- offload: FSDP2 with CPU offload, pinned and not, on a one-rank mesh (FSDP is forced on: a one-rank job skips it),
  against the same run without offload; and torch's own behaviour when offloaded parameters are materialized on the
  GPU, as they were before train.py built them on the host;
- syncs: steps that only train, under torch.cuda.set_sync_debug_mode: every op that makes the host wait (a value
  read, a copy from pageable memory), with pinned batches and without;
- step8b: two Llama 3 8B blocks (with its 128k vocabulary) at seq 8192, bf16, eager and compiled: tokens/s and MFU
  of our model code at the real shapes, against the H100 peak (metrics.peak_flops);
- float8: the debug model with torchao's float8 matmuls (tensorwise, rowwise) against the same recipe emulated (what
  every CPU test runs) and against the run without float8, in fp32 and bf16;
- float8_fsdp: float8 under FSDP2 with the float8 all-gather and the scale precompute against without;
- float8_8b: four 8B blocks compiled, bf16 against float8 tensorwise and rowwise: tokens/s, MFU (against the bf16
  peak, so the ratio reads as a speed-up), peak memory;
- masked: block_causal with FlexAttention's block mask against the explicit mask, eager, compiled and bf16;
- mask_memory: the block mask's peak bytes at 8192 and 32k tokens, ours beside create_block_mask's (on a CPU too);
- observe: a profiled run's trace holds the GPU's kernels, memory snapshots every profile_freq steps, and a step that
  runs out of memory writes its snapshot and exits 1 with its one line;
- moe: benchmarks/moe_step.py (grouped GEMM against the loop, MoE against dense, compile, empty experts, MXFP8
  experts), the debug MoE model's fp32 curve against the same run on the CPU, and its training steps' syncs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

ROOT = Path(__file__).resolve().parents[1]
import train  # noqa: E402
from torchtitan_lite.data.loader import DataLoader  # noqa: E402
from torchtitan_lite.models.registry import get  # noqa: E402
from torchtitan_lite.parallel.dims import ParallelDims  # noqa: E402
from torchtitan_lite.runtime.metrics import storage_bytes  # noqa: E402
from torchtitan_lite.runtime.run_history import read_metrics  # noqa: E402
import moe_step  # noqa: E402 - benchmarks/, beside this script
from speed_8b import blocks8b, float8_linear_ms  # noqa: E402

TINY = str(ROOT / "tests/assets/tiny.toml")
DEBUGMODEL = ("--model.flavor", "debugmodel")  # the reference's model, not tiny.toml's 2 blocks
REFERENCE = ROOT / "tests/assets/losses/debugmodel_cpu.txt"


def run(*args: str, steps: int = 50) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        code = train.run(["--job.config_file", TINY, *DEBUGMODEL, "--job.dump_folder", tmp,
                          "--training.steps", str(steps), *args])
        assert code == 0, f"train.run exited {code}"
        return read_metrics(tmp)


def gap(a: list[dict], b: list[dict], key: str = "loss") -> float:
    return max(abs(x[key] - y[key]) for x, y in zip(a, b))


def attempt(out: dict, key: str, fn) -> None:
    """out[key] = fn(), or the error it raised (one broken variant must not hide the others), printed as it lands."""
    try:
        out[key] = fn()
    except Exception as e:  # noqa: BLE001 - a report, not a test
        out[key] = {"error": f"{type(e).__name__}: {e}"[:300], "where": traceback.format_exc()[-800:]}
    print(json.dumps({key: out[key]}), flush=True)


def reference() -> dict:
    ref = {int(s): float(v) for s, v in (line.split() for line in REFERENCE.read_text().splitlines()
                                         if line and not line.startswith("#"))}
    fp32 = run()
    return {"max |loss - CPU reference|": max(abs(r["loss"] - ref[r["step"]]) for r in fp32),
            "loss at 50": fp32[-1]["loss"], "grad_norm at 1": fp32[0]["grad_norm"]}


def init() -> dict:
    from torchtitan_lite.models.init import fill_block_  # noqa: PLC0415 - this check's alone

    def timed(fn, repeats: int = 10) -> float:
        fn()  # the first call builds the tables and buffers
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        return round((time.perf_counter() - t0) / repeats * 1e3, 3)

    def debug_model(device: str) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            model = get("llama3").model_class(get("llama3").args("debugmodel", 2048, 64))
        model.to_empty(device=device).init_weights(seed=0)
        return {n: p.detach().cpu() for n, p in model.named_parameters()}

    cpu, gpu = debug_model("cpu"), debug_model("cuda")
    out = {"debug model: parameters bitwise equal to the CPU's": f"{sum(torch.equal(cpu[n], gpu[n]) for n in cpu)} "
                                                                 f"of {len(cpu)}"}
    shape, rows = (4096, 14336), 4096 // 8  # rank 3's rows of an 8B FFN matrix under FSDP 8
    shard = {d: torch.empty(rows, shape[1], device=d) for d in ("cpu", "cuda")}
    fill = {d: (lambda d=d: fill_block_(shard[d], shape, (3 * rows, 0), 0.02, float("inf"), "0/ffn"))
            for d in shard}
    fill["cpu"]()
    out["8B FFN shard ms"] = timed(fill["cuda"])
    out["8B FFN shard: bitwise equal to the CPU's"] = torch.equal(shard["cuda"].cpu(), shard["cpu"])
    out["normal_ ms"] = timed(lambda: shard["cuda"].normal_(0, 0.02))
    return out


def precisions() -> dict:
    fp32 = run(steps=20)
    out = {}
    for dtype in ("bfloat16", "float16"):
        recs = run("--training.mixed_precision_param", dtype, steps=20)
        out[dtype] = {"max |loss - fp32|": gap(recs, fp32), "loss at 20": recs[-1]["loss"],
                      **{k: recs[-1][k] for k in ("loss_scale", "skipped_steps") if k in recs[-1]}}
    return out


def offload() -> dict:
    out = {}
    fsdp = ParallelDims.fsdp
    ParallelDims.fsdp = property(lambda self: True)  # FSDP2 on the one-rank mesh, as on a dp_shard dim of N
    try:
        plain = run(steps=4)
        for pin in (True, False):
            try:
                recs = run("--parallelism.fsdp_cpu_offload", f"--parallelism.fsdp_offload_pin_memory={pin}", steps=4)
                out[f"pin {pin}"] = {"max |loss - no offload|": gap(recs, plain),
                                     "grad_norm rel diff": gap(recs, plain, "grad_norm") / plain[0]["grad_norm"]}
            except Exception as e:  # noqa: BLE001 - a report, not a test
                out[f"pin {pin}"] = {"error": f"{type(e).__name__}: {e}"[:300], "where": traceback.format_exc()[-600:]}
    finally:
        ParallelDims.fsdp = fsdp
    out["torch, materialized on the GPU"] = _fsdp_offload_on_gpu()
    return out


def _fsdp_offload_on_gpu() -> dict:
    """What FSDP2 does with offloaded parameters that to_empty put on the GPU (train.py's old materialization)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    mesh, out = init_device_mesh("cuda", (1,)), {}
    try:
        for pin in (True, False):
            with torch.device("meta"):
                model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
            for layer in model:
                fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin))
            fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin))
            model.to_empty(device="cuda")
            try:
                model(torch.randn(2, 64, device="cuda")).sum().backward()
                out[f"pin {pin}"] = f"trains; sharded params on {model[0].weight.to_local().device}"
            except Exception as e:  # noqa: BLE001
                out[f"pin {pin}"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        dist.destroy_process_group()
    return out


def syncs(*args: str) -> dict:
    """Syncs per step of steps 2..9 (logging at step 10 only), with pinned batches (train.py) and pageable ones."""
    out = {}
    for pinned in (True, False):
        next_batch, step, seen = DataLoader.next_batch, [0], {}

        def counting(self, next_batch=next_batch):
            step[0] += 1
            torch.cuda.set_sync_debug_mode("warn" if 2 <= step[0] <= 9 else "default")
            if not pinned:
                self.pin = False
            return next_batch(self)

        DataLoader.next_batch = counting
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run("--metrics.log_freq", "10", *args, steps=10)
        finally:
            DataLoader.next_batch = next_batch
            torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchronizing" in str(w.message):
                site = f"{'/'.join(Path(w.filename).parts[-2:])}:{w.lineno}"
                seen[site] = seen.get(site, 0) + 1
        out["pinned" if pinned else "pageable"] = {"syncs in 8 training steps": sum(seen.values()), "sites": seen}
    return out


def step8b() -> dict:
    return {"eager": blocks8b(False), "compiled": blocks8b(True)}


def float8_8b(n_layers: int = 4) -> dict:
    """Four blocks: with two, the unconverted output projection (128k vocabulary) does half of the matmul work."""
    out = {"bf16 compiled": blocks8b(True, n_layers=n_layers)}
    for recipe in ("tensorwise", "rowwise"):
        recipe_args = ("--float8.recipe_name", recipe)
        attempt(out, f"float8 {recipe} compiled", lambda args=recipe_args: blocks8b(True, args, n_layers))
        if "tokens/s" in out[f"float8 {recipe} compiled"]:
            out[f"float8 {recipe} / bf16"] = round(out[f"float8 {recipe} compiled"]["tokens/s"]
                                                   / out["bf16 compiled"]["tokens/s"], 3)
    out["one FFN linear (8192 x 4096 -> 14336), forward + backward"] = float8_linear_ms()
    return out


def _against_emulation(f8: tuple[str, ...], plain: list[dict]) -> dict:
    real, emulated = run(*f8, steps=20), run(*f8, "--float8.emulate", steps=20)
    return {"step 1 |loss real - emulated|": abs(real[0]["loss"] - emulated[0]["loss"]),
            "step 1 grad_norm rel diff real/emulated": abs(real[0]["grad_norm"] / emulated[0]["grad_norm"] - 1),
            "max |loss real - emulated|": gap(real, emulated), "max |loss real - no float8|": gap(real, plain),
            "step 1 |loss real - no float8|": abs(real[0]["loss"] - plain[0]["loss"]), "loss at 20": real[-1]["loss"]}


def float8_numerics() -> dict:
    """20 steps of the debug model: real float8 kernels against emulated ones and against no float8."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        precision = ("--training.mixed_precision_param", dtype)
        plain = run(*precision, steps=20)
        for recipe in ("tensorwise", "rowwise"):
            f8 = (*precision, "--float8.enable_float8_linear", "--float8.recipe_name", recipe)
            attempt(out, f"{dtype} {recipe}", lambda f8=f8, plain=plain: _against_emulation(f8, plain))
    return out


def float8_fsdp() -> dict:
    """Float8 under FSDP2 (forced on the one-rank mesh) with torchao's float8 all-gather and the scale precompute,
    against the same run all-gathering the weights in the compute dtype (fp32: bitwise equal on the CPU)."""
    fsdp, out = ParallelDims.fsdp, {}
    ParallelDims.fsdp = property(lambda self: True)
    try:
        for dtype in ("float32", "bfloat16"):
            f8 = ("--training.mixed_precision_param", dtype, "--float8.enable_float8_linear")
            plain = run(*f8, steps=10)
            gathered = run(*f8, "--float8.enable_fsdp_float8_all_gather",
                           "--float8.precompute_float8_dynamic_scale_for_fsdp", steps=10)
            out[dtype] = {"max |loss fp8 all-gather - without|": gap(gathered, plain),
                          "max grad_norm rel diff": gap(gathered, plain, "grad_norm") / plain[0]["grad_norm"],
                          "loss at 10": gathered[-1]["loss"]}
    finally:
        ParallelDims.fsdp = fsdp
    return out


def _flex_against_explicit(args: tuple[str, ...]) -> dict:
    from torchtitan_lite.models import documents

    flex, kernel = run(*args, steps=20), documents.kernel
    documents.kernel = lambda device_type, cp: "sdpa"
    try:
        sdpa = run(*args, steps=20)
    finally:
        documents.kernel = kernel
    return {"max |loss flex - explicit mask|": gap(flex, sdpa),
            "step 1 grad_norm rel diff": abs(flex[0]["grad_norm"] / sdpa[0]["grad_norm"] - 1),
            "loss at 20": flex[-1]["loss"]}


def masked() -> dict:
    """block_causal on the GPU: FlexAttention's block mask (what a GPU run uses) against SDPA with the explicit mask
    (the CPU's kernel, forced here), 20 steps of short documents, eager and compiled, fp32 and bf16."""
    data = ("--model.attn_mask_type", "block_causal", "--training.dataset", "jsonl", "--training.dataset_path",
            str(ROOT / "tests" / "assets" / "documents.jsonl"))
    out = {}
    for name, extra in (("fp32", ()), ("fp32 compiled", ("--compile.enable",)),
                        ("bf16", ("--training.mixed_precision_param", "bfloat16"))):
        attempt(out, name, lambda extra=extra: _flex_against_explicit((*data, *extra)))
    return out


def _peak(device: torch.device, fn) -> tuple:
    """(fn(), the most bytes it had allocated at once beyond what was allocated before)."""
    if device.type == "cuda":  # the allocator's statistics are the host's: no sync needed before
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base
    with MemTracker() as tracker:  # the CPU has no allocator statistics: the tensors' storages, followed
        out = fn()
    return out, tracker.get_tracker_snapshot("peak")[device]["Total"]


def mask_memory(device: str | None = None, seqs: tuple[int, ...] = (8192, 32768)) -> dict:
    """block_causal's block mask of a window (documents of ~1000 tokens) built from the ids (ours), by torch's
    create_block_mask (ours before) and by it compiled (torchtitan's; GPU): its peak and bytes held, and on a GPU the
    peak of building and using it (compiled FlexAttention forward and backward, 8B's 32 heads of 128, bf16)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan_lite.models import documents

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torchs = {"create_block_mask": create_block_mask}
    if device.type == "cuda":
        torchs["create_block_mask compiled"] = torch.compile(create_block_mask)
    builders = {"from ids": lambda ids: documents.block_mask(ids, torch.bfloat16), **{
        name: (lambda ids, f=f: f(documents.document_causal(ids), 1, None, ids.shape[1], ids.shape[1], device=device))
        for name, f in torchs.items()}}
    flex, out = torch.compile(flex_attention), {}
    for seq in seqs:
        ids = documents.document_ids((torch.rand(1, seq, generator=torch.Generator().manual_seed(seq)) < 1e-3)
                                     .long(), 1).to(device)
        row, reference = {"estimate (block_mask_bytes)": documents.block_mask_bytes(1, seq)}, None
        for name, build in builders.items():
            if device.type == "cuda":
                build(ids)  # compiled: compiles outside the measurement
            mask, peak = _peak(device, lambda build=build: build(ids))
            tensors = [t for t in mask.as_tuple() if isinstance(t, torch.Tensor)]
            reference = reference or tensors
            row[name] = {"build peak MiB": round(peak / 2**20, 3), "held bytes": storage_bytes(tensors),
                         "equal to ours": all(a.equal(b) for a, b in zip(tensors, reference))}
            if device.type == "cuda":
                q, k, v = (torch.randn(1, 32, seq, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                flex(q, k, v, block_mask=mask).sum().backward()  # compiles (per length) outside the measurement
                del mask
                _, peak = _peak(device, lambda build=build: flex(q, k, v, block_mask=build(ids)).sum().backward())
                row[name]["build, forward and backward peak MiB"] = round(peak / 2**20, 1)
        out[f"seq {seq}"] = row
    return out


def observe() -> dict:
    """Profiler traces with GPU kernels, periodic memory snapshots, and the snapshot an out-of-memory step writes."""
    import gzip
    import pickle

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        code = train.run(["--job.config_file", TINY, *DEBUGMODEL, "--job.dump_folder", tmp, "--training.steps", "4",
                          "--profiling.enable_profiling", "--profiling.enable_memory_snapshot",
                          "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "0"])
        traces = sorted(Path(tmp).glob("profile_traces/*/*_trace.json.gz"))
        snaps = sorted(Path(tmp).glob("memory_snapshot/*/*.pickle"))
        events = json.loads(gzip.decompress(traces[-1].read_bytes()))["traceEvents"] if traces else []
        snapshot = pickle.loads(snaps[-1].read_bytes()) if snaps else {}
        out["profiled run"] = {
            "exit": code, "traces": [str(t.relative_to(tmp)) for t in traces],
            "kernel events in the last": sum(e.get("cat") == "kernel" for e in events),
            "phases": sorted({e["name"] for e in events if e.get("cat") == "user_annotation"})[:12],
            "snapshots": [str(p.relative_to(tmp)) for p in snaps],
            "segments, trace entries in the last": [len(snapshot.get("segments", [])),
                                                    sum(len(t) for t in snapshot.get("device_traces", []))]}
    with tempfile.TemporaryDirectory() as tmp:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):  # the job's one error line
            code = train.run(["--job.config_file", TINY, *DEBUGMODEL, "--job.dump_folder", tmp, "--training.steps", "2",
                              "--training.seq_len", "8192", "--training.local_batch_size", "512",
                              "--metrics.log_freq", "1"])
        lines = stderr.getvalue().splitlines()
        snaps = sorted(Path(tmp).glob("memory_snapshot/*/*.pickle"))
        out["out of memory"] = {"exit": code, "snapshots": [str(p.relative_to(tmp)) for p in snaps],
                                "snapshot bytes": snaps[-1].stat().st_size if snaps else 0,
                                "line": next((line for line in lines if "out of GPU memory" in line), None)}
    torch.cuda.empty_cache()
    return out


CHECKS = {"moe": lambda: moe_step.gpu_check(run, syncs), "reference": reference, "init": init, "precisions": precisions, "offload": offload, "syncs": syncs, "step8b": step8b,
          "float8": float8_numerics, "float8_8b": float8_8b, "observe": observe, "masked": masked,
          "float8_fsdp": float8_fsdp, "mask_memory": mask_memory}
RUN_ON_CPU = {"mask_memory"}  # what a machine without a GPU measures too; the others are reported skipped there


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", choices=list(CHECKS), default=list(CHECKS))
    p.add_argument("--out", help="also write the results here, as JSON")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    for name in a.only:
        t0 = time.perf_counter()
        try:
            results[name] = CHECKS[name]() if cuda or name in RUN_ON_CPU else "skipped: needs a GPU"
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            results[name] = {"error": f"{type(e).__name__}: {e}"[:500], "where": traceback.format_exc()[-1500:]}
        results[name + " s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
