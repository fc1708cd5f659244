"""The paths a CPU cannot take, run on one GPU: what a session lent a GPU checks in one command.

    python benchmarks/gpu_paths.py [--only NAME ...] [--out FILE.json]

Each check is a real train.run (one process; a one-rank mesh) or the model's own step, on cuda:
- reference: the debug model's fp32 curve (tests/assets/tiny.toml, 50 steps) against the committed CPU curve;
- bf16, fp16: the same run under autocast (fp16 with loss scaling): the gap to fp32, the loss scale, skipped steps;
- offload: FSDP2 with CPU offload, pinned and not, on a one-rank mesh (FSDP is forced on: a one-rank job skips it),
  against the same run without offload; and torch's own behaviour when offloaded parameters are materialized on the
  GPU, as they were before train.py built them on the host;
- syncs: steps that only train, under torch.cuda.set_sync_debug_mode: every op that makes the host wait (a value
  read, a copy from pageable memory), with pinned batches and without;
- step8b: two Llama 3 8B blocks (with its 128k vocabulary) at seq 8192, bf16, eager and compiled: tokens/s and MFU
  of our model code at the real shapes, against the H100 peak (metrics.peak_flops).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
import train  # noqa: E402
from torchtitan_lite.data.loader import DataLoader  # noqa: E402
from torchtitan_lite.models.llama import Transformer, count_params, flavor_args  # noqa: E402
from torchtitan_lite.parallel.dims import ParallelDims  # noqa: E402
from torchtitan_lite.runtime.metrics import flops_per_token, peak_flops  # noqa: E402
from torchtitan_lite.runtime.run_history import read_metrics  # noqa: E402

TINY = str(ROOT / "tests/assets/tiny.toml")
REFERENCE = ROOT / "tests/assets/losses/debugmodel_cpu.txt"


def run(*args: str, steps: int = 50) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        code = train.run(["--job.config_file", TINY, "--job.dump_folder", tmp, "--training.steps", str(steps), *args])
        assert code == 0, f"train.run exited {code}"
        return read_metrics(tmp)


def gap(a: list[dict], b: list[dict], key: str = "loss") -> float:
    return max(abs(x[key] - y[key]) for x, y in zip(a, b))


def reference() -> dict:
    ref = {int(s): float(v) for s, v in (line.split() for line in REFERENCE.read_text().splitlines()
                                         if line and not line.startswith("#"))}
    fp32 = run()
    return {"max |loss - CPU reference|": max(abs(r["loss"] - ref[r["step"]]) for r in fp32),
            "loss at 50": fp32[-1]["loss"], "grad_norm at 1": fp32[0]["grad_norm"]}


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


def syncs() -> dict:
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
                run("--metrics.log_freq", "10", steps=10)
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
    args = flavor_args("8B", 128256, 8192).with_(n_layers=2)
    device, out = torch.device("cuda"), {}
    for compiled in (False, True):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Transformer(args)
        model.to_empty(device=device)
        model.init_weights()
        if compiled:
            for block in model.layers.values():
                block.compile(fullgraph=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tokens = torch.randint(0, args.vocab_size, (1, 8193), device=device)
        times = []
        for i in range(13):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        n_params, n_embedding = count_params(model)
        token_flops = flops_per_token(n_params, args.n_layers, args.n_heads, args.head_dim, 8192, n_embedding)
        tps = 8192 / sorted(times)[len(times) // 2]
        out["compiled" if compiled else "eager"] = {
            "tokens/s": round(tps), "MFU %": round(100 * tps * token_flops / peak_flops(device, torch.bfloat16), 1),
            "peak GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
        del model, opt, logits, loss
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


CHECKS = {"reference": reference, "precisions": precisions, "offload": offload, "syncs": syncs, "step8b": step8b}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", choices=list(CHECKS), default=list(CHECKS))
    p.add_argument("--out", help="also write the results here, as JSON")
    a = p.parse_args()
    assert torch.cuda.is_available(), "gpu_paths.py checks GPU-only paths: run it on a GPU"
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in a.only:
        t0 = time.perf_counter()
        try:
            results[name] = CHECKS[name]()
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            results[name] = {"error": f"{type(e).__name__}: {e}"[:500], "where": traceback.format_exc()[-1500:]}
        results[name + " s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
