"""Per-rank state bytes under FSDP2: parameters, gradients and AdamW state at 1, 2 and 4 ranks, with CPU offload and
with hpZ, measured on real gloo processes; and the parameter bytes each reshard policy keeps between forward and
backward.

    python benchmarks/fsdp_memory.py

Each layout is a torchrun job of this file (CUDA_VISIBLE_DEVICES="", --standalone) that builds the model like the
trainer (meta, parallelize, to_empty), runs one step of the debug model on 2 x 64 random tokens and records
metrics.held_bytes on rank 0; no training loop, so the figures are the state alone. Between forward and backward it
walks the FSDP parameters (private FSDP2 attributes, acceptable in a benchmark) and counts what each keeps: the
sharded parameter always, plus the unsharded parameter (not resharded) or hpZ's post-forward shard.
The last line is the one figure: 4-rank state bytes as a fraction of 1 rank's, plus the constant left over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BASE = ("--job.config_file", str(ROOT / "tests" / "assets" / "tiny.toml"), "--model.flavor", "debugmodel",
        "--training.seq_len", "64")
NO_PIN = ("--no-parallelism.fsdp_offload_pin_memory",)  # pinned memory needs a GPU
OFFLOAD = ("--parallelism.fsdp_cpu_offload", *NO_PIN)
# (label, ranks, overrides)
LAYOUTS = [
    ("1 rank", 1, ()),
    ("FSDP 2", 2, ()),
    ("FSDP 4", 4, ()),
    ("FSDP 2, CPU offload", 2, OFFLOAD),
    ("FSDP 4, CPU offload", 4, OFFLOAD),
    ("FSDP 4, reshard default", 4, ("--parallelism.fsdp_reshard_after_forward", "default")),
    ("FSDP 4, reshard always", 4, ("--parallelism.fsdp_reshard_after_forward", "always")),
    ("FSDP 4, hpZ 2", 4, ("--parallelism.fsdp_reshard_after_forward", "2")),
    ("FSDP 4, reshard never", 4, ("--parallelism.fsdp_reshard_after_forward", "never")),
]
STATE = ("param_bytes", "grad_bytes", "optimizer_bytes")


def params_between_forward_and_backward(model) -> int:
    """Bytes of parameter storage alive after forward: shards, kept unsharded parameters, hpZ post-forward shards."""
    from torch.distributed.fsdp import FSDPModule

    from torchtitan_lite.runtime.metrics import storage_bytes

    kept = []
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for p in group.fsdp_params if group else ():
            kept.append(p._sharded_param_data)
            if p.sharded_state.name == "UNSHARDED":
                kept.append(p._unsharded_param)
            elif p.sharded_state.name == "SHARDED_POST_FORWARD":
                kept.append(p._sharded_post_forward_param_data)
    return storage_bytes(kept)


def worker(out: str, argv: list[str]) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from torchtitan_lite.config import load_config
    from torchtitan_lite.models import registry
    from torchtitan_lite.parallel.dims import ParallelDims
    from torchtitan_lite.parallel.parallelize import parallelize
    from torchtitan_lite.runtime.metrics import held_bytes
    from torchtitan_lite.tools.memory import model_args
    from torchtitan_lite.training.optimizers import build_optimizer

    cfg = load_config(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo")
    dims = ParallelDims.from_config(cfg.parallelism, world)
    mesh = dims.build_mesh("cpu")[0]
    spec = registry.get(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_class(model_args(cfg)[0])
    parallelize(model, mesh, dims, cfg, spec.tp_plan)
    model.to_empty(device="cpu")
    model.init_weights()
    optimizer = build_optimizer(model, cfg, "cpu")
    tokens = torch.randint(0, model.args.vocab_size, (2, cfg.training.seq_len))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    kept = params_between_forward_and_backward(model) if dims.fsdp else held_bytes(model, optimizer)["param_bytes"]
    loss.backward()
    optimizer.step()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({**held_bytes(model, optimizer), "kept_after_forward": kept}))
    dist.destroy_process_group()


def measure(ranks: int, overrides: tuple[str, ...]) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "held.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", __file__,
               "--worker", out, *BASE, *overrides]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600)
        return json.loads(Path(out).read_text())


def main() -> None:
    results = {label: (ranks, measure(ranks, overrides)) for label, ranks, overrides in LAYOUTS}
    one = sum(results["1 rank"][1][k] for k in STATE)
    print(f"{'layout':<26}{'params':>10}{'grads':>10}{'optimizer':>11}{'state':>10}{'x 1 rank':>10}"
          f"{'params after fwd':>18}  (bytes per rank, rank 0)")
    for label, (ranks, r) in results.items():
        state = sum(r[k] for k in STATE)
        print(f"{label:<26}{r['param_bytes']:>10}{r['grad_bytes']:>10}{r['optimizer_bytes']:>11}{state:>10}"
              f"{state / one:>10.4f}{r['kept_after_forward']:>18}")
    four = sum(results["FSDP 4"][1][k] for k in STATE)
    print(f"4-rank / 1-rank state bytes: 0.25x + {four - one / 4:.0f} B ({four / one:.4f}x)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3:])
    else:
        main()
