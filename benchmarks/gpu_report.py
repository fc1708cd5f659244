"""One command for the first user with a GPU node: what decides a config's speed and correctness there, measured.

    python benchmarks/gpu_report.py [--config F] [--nproc N] [--steps 20] [--warmup 5] [--backend inductor]
                                    [-- overrides...]

On a GPU node it runs `--config` (default train_configs/llama3_8b.toml) on every GPU; on a CPU the debug model on 4
processes (CI runs it so, tests/multiprocess/test_gpu_report.py: the script is never untested). Every job is a real
torchrun job of train.py with the overrides given, validation and checkpoints off. It prints:
- tokens/s per device and MFU, eager and compiled (medians over the steps after --warmup: compiling is paid once),
  and each job's peak memory: torch.cuda.max_memory_allocated on a GPU, the resident set on a CPU;
- scripts/estimate_memory.py's peak for the same config and world size (the GPU figure to compare with; on a CPU the
  resident set also holds torch's code and the data, so the two are not comparable);
- host-device syncs of a step that only trains (0 expected: benchmarks/sync_count.py) and of a logging step;
- the collectives of one step, by kind and mesh dimension, with their bytes (benchmarks/comm_count.py);
- torchtitan's published figures beside ours where the config matches one of theirs (their float8 row too: the
  8B config with `-- --float8.enable_float8_linear --training.local_batch_size 2` on 8 GPUs).
Float8 (float8.enable_float8_linear) is passed to every job like any override; its MFU is against the fp8 peak
(docs/float8.md), and on a CPU it needs --float8.emulate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from torchtitan_lite.config import load_config  # noqa: E402
from torchtitan_lite.parallel.dims import ParallelDims  # noqa: E402
from torchtitan_lite.quantization import float8  # noqa: E402
from torchtitan_lite.runtime.run_history import read_metrics  # noqa: E402
from torchtitan_lite.tools.sync_count import HOST_READS  # noqa: E402

# torchtitan's published Llama 3 figures (benchmarks/llama3_h100_202412_torchtitan.md: H100, bf16, FSDP, selective
# AC): (flavor, world, tp, seq_len, local batch, float8 recipe or None) -> figures. Their float8 row is compiled only
# and has no MFU (two kinds of tensor cores at work: they call it ill-defined; ours is against the fp8 peak).
PUBLISHED = {
    ("8B", 8, 1, 8192, 2, None): {"source": "torchtitan, 8 x H100 (96 GB), FSDP 8", "eager tokens/s": 5762,
                                  "compiled tokens/s": 6667, "eager MFU %": 33.7, "compiled MFU %": 39.0,
                                  "eager peak GiB": 82.4, "compiled peak GiB": 77.0},
    ("8B", 8, 1, 8192, 2, "tensorwise"): {
        "source": "torchtitan, 8 x H100 (96 GB), FSDP 8, compiled, float8 tensorwise (launched, per their float8 "
                  "docs of the time, with the float8 all-gather and the scale precompute); their compiled bf16 run: "
                  "6,667 tokens/s, float8 x1.28",
        "compiled tokens/s": 8532, "compiled peak GiB": 76.8},
}
COMMON = ("--metrics.log_freq", "1", "--no-validation.enable", "--no-checkpoint.enable")


def gpus() -> int:
    import torch  # noqa: PLC0415 - only to count devices

    return torch.cuda.device_count()


def torchrun(nproc: int, config: str, dump: str, args: list[str], script: str = "train.py",
             script_args: tuple[str, ...] = ()) -> list[dict]:
    """One torchrun job of train.py, or of a benchmarks/ probe (train.py wrapped to record): its metrics records.
    The config was checked once above, so the jobs skip run_train.sh's check."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / script), *script_args, "--job.config_file", config, "--job.dump_folder", dump, *COMMON, *args]
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))  # the caller's kept: the tests'
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{script} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    metrics = Path(dump) / "metrics.jsonl"  # comm_count.py writes its runs' into folders of their own
    return read_metrics(metrics) if metrics.exists() else []


def published(cfg, nproc: int) -> dict | None:
    """torchtitan's figures for this config and world size, if it is one they published."""
    t = cfg.training
    recipe = cfg.float8.recipe_name if float8.enabled(cfg) else None
    return PUBLISHED.get((cfg.model.flavor, nproc, cfg.parallelism.tensor_parallel_degree, t.seq_len,
                          t.local_batch_size, recipe))


def speed(records: list[dict], warmup: int) -> dict[str, float]:
    timed = [r for r in records if r["step"] > warmup] or records[-1:]
    return {"tokens/s": statistics.median(r["tps"] for r in timed), "MFU %": statistics.median(r["mfu"] for r in timed),
            "peak GiB": max(r["memory_gib"] for r in records)}


def float8_summary(cfg, fsdp: bool) -> str:
    """The float8 part of the header line: what decides its speed and its all-gather bytes."""
    if not float8.enabled(cfg):
        return ""
    f8 = cfg.float8
    return (f", float8 {f8.recipe_name}{', float8 all-gather' if float8.all_gathers_float8(cfg, fsdp) else ''}"
            f"{', emulated' if f8.emulate else ''}")


def group_names(dims: ParallelDims) -> dict[tuple[int, ...], str]:
    """Rank 0's group along each dimension of train.py's mesh (pp, dp_replicate, dp_shard, cp, tp; row-major) by its
    ranks, FSDP's over dp_shard x cp under context parallelism, and the world."""
    sizes = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp}
    strides, stride = {}, 1
    for dim in reversed(sizes):
        strides[dim], stride = stride, stride * sizes[dim]
    names = {tuple(range(0, n * strides[d], strides[d])): d for d, n in sizes.items() if n > 1}
    if dims.cp > 1 and dims.dp_shard > 1:
        names[tuple(range(0, dims.dp_shard * dims.cp * dims.tp, dims.tp))] = "dp_shard x cp"
    return names | {tuple(range(dims.world_size)): "world"}


def main() -> None:
    on_gpu = gpus() > 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = "llama3_8b.toml" if on_gpu else "debug_model.toml"
    p.add_argument("--config", default=str(ROOT / "train_configs" / default))
    p.add_argument("--nproc", type=int, default=gpus() or 4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the speed figures")
    p.add_argument("--backend", default="inductor", help="compile.backend of the compiled job")
    p.add_argument("overrides", nargs="*", help="config overrides for every job (after --)")
    a = p.parse_args()
    args = ["--training.steps", str(a.steps), *a.overrides]
    check = subprocess.run([sys.executable, "train.py", "--check", "--job.config_file", a.config, *args], cwd=ROOT,
                           env={**os.environ, "WORLD_SIZE": str(a.nproc)}, capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(check.stderr.strip())  # the trainer's one line: the jobs below would all fail on it
    cfg = load_config(["--job.config_file", a.config, *args])
    t, par = cfg.training, cfg.parallelism
    print(f"config {a.config}: {cfg.model.flavor}, {a.nproc} {'GPUs' if on_gpu else 'CPU processes'}, "
          f"seq {t.seq_len} x local batch {t.local_batch_size}, {t.mixed_precision_param}, "
          f"AC {cfg.activation_checkpoint.mode}, TP {par.tensor_parallel_degree}, CP {par.context_parallel_degree}, "
          f"PP {par.pipeline_parallel_degree}{float8_summary(cfg, ParallelDims.from_config(par, a.nproc).fsdp)}")

    from torchtitan_lite.config import ConfigError  # noqa: PLC0415
    from torchtitan_lite.tools.memory import estimate_memory  # noqa: PLC0415 - imports torch: after the cheap checks

    try:
        estimate = f"{estimate_memory(cfg, a.nproc).peak_bytes / 2**30:>12,.1f}"
    except ConfigError as e:  # a model the estimate does not know: the rest of the report stands
        estimate = f"  none: {e}"
    with tempfile.TemporaryDirectory() as tmp:
        ours = {"eager": speed(torchrun(a.nproc, a.config, f"{tmp}/eager", [*args, "--no-compile.enable"]), a.warmup),
                "compiled": speed(torchrun(a.nproc, a.config, f"{tmp}/compiled", [
                    *args, "--compile.enable", "--compile.backend", a.backend]), a.warmup)}
        # Logging every 3rd step of 6, so steps 2, 4 and 5 only train; the last one also logs.
        torchrun(a.nproc, a.config, f"{tmp}/syncs", [*args, "--training.steps", "6", "--metrics.log_freq", "3"],
                 "benchmarks/sync_count.py", (f"{tmp}/syncs",))
        syncs = json.loads(Path(f"{tmp}/syncs/syncs-0.json").read_text())
        torchrun(a.nproc, a.config, f"{tmp}/comms", [*args, "--training.steps", "3", "--metrics.log_freq", "10"],
                 "benchmarks/comm_count.py", (f"{tmp}/comms", json.dumps({"step": []})))
        comms = json.loads(Path(f"{tmp}/comms/step.json").read_text())

    theirs = published(cfg, a.nproc) or {}
    print(f"\n{'':<22}{'ours':>12}{'published' if theirs else '':>12}")
    for mode in ("eager", "compiled"):
        for key in ("tokens/s", "MFU %", "peak GiB"):
            figure = theirs.get(f"{mode} {key}")
            print(f"{mode + ' ' + key:<22}{ours[mode][key]:>12,.1f}{'' if figure is None else f'{figure:>12,.1f}'}")
    print(f"{'estimated peak GiB':<22}{estimate}")
    if theirs:
        print(f"published: {theirs['source']}")

    def device(sites: list[str]) -> int:  # a host tensor's read waits for no device (sync_count.HOST_READS)
        return sum(1 for s in sites if (s.endswith("@cuda") if on_gpu else s not in HOST_READS))

    print(f"\ndevice syncs: steps that only train {[device(syncs[s]) for s in ('2', '4', '5')]}, "
          f"a logging step {device(syncs['3'])}")
    names = group_names(ParallelDims.from_config(par, a.nproc))
    counts, nbytes = Counter(), Counter()
    for kind, ranks, size in comms:
        group = names.get(tuple(ranks), f"{len(ranks)} ranks")
        counts[kind, group] += 1
        nbytes[kind, group] += size
    print("collectives of one step (per rank, over rank 0's group; full-buffer MB):")
    for (kind, group), n in sorted(counts.items()):
        print(f"  {n:>4} {kind:<16} {group:<14} {nbytes[kind, group] / 1e6:>10.1f} MB")
    print(f"compiled/eager tokens/s: {ours['compiled']['tokens/s'] / ours['eager']['tokens/s']:.3f}")


if __name__ == "__main__":
    main()
