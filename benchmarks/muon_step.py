"""Muon against AdamW on the CPU, through the trainer: the step's time and the optimizer's state on 1 process and on
FSDP 4, and the loss after N steps of the debug model for each at its best lr of a small sweep.

    python benchmarks/muon_step.py [--steps 12] [--sweep_steps 40] [--lrs 1e-3,3e-3,1e-2,3e-2] [--skip_sweep]
                                   [--skip_timing]

Time and memory: the debug model (6 blocks of 256) on 8 sequences of 256 tokens a step, each optimizer's run twice,
interleaved (AdamW, Muon, AdamW, Muon) so that drift on a shared machine hits both alike; the figure of a run is the
median step time over its steps after the first two (metrics.jsonl's elapsed time between records), and its
optimizer_bytes (the state per rank). The last line of the part is `Muon/AdamW step time: X on 1 process, Y on
FSDP 4`. Muon's extra cost under FSDP is what exactness costs: each matrix gathered whole and its orthogonalized
form summed back over the mesh (training/muon.py).

The sweep: the debug model on 1 process, `--sweep_steps` steps of 4 x 128 tokens of the project's BPE on the Python
standard library (the trainer's default data), each optimizer at each lr of `--lrs`; the figure is the mean loss of
the last 5 steps. Muon's matrices' lr is adjusted to AdamW's update size (match_rms_adamw), so one lr range serves
both. The last line: `best loss: AdamW X (lr a), Muon Y (lr b)`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ("--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--lr_scheduler.warmup_steps", "2",
         "--lr_scheduler.decay_ratio", "0", "--metrics.log_freq", "1", "--no-validation.enable",
         "--no-checkpoint.enable", "--parallelism.tensor_parallel_degree", "1")


def run(folder: Path, nproc: int, *overrides: str, launcher: tuple[str, ...] = ()) -> list[dict]:
    """The step records of a train.py run of `nproc` processes in `folder`, started by `launcher` (e.g. taskset)."""
    cmd = [*launcher, *([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                        if nproc > 1 else [sys.executable])]
    subprocess.run([*cmd, str(ROOT / "train.py"), *MODEL, "--job.dump_folder", str(folder), *overrides],
                   check=True, capture_output=True, cwd=ROOT)
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def step_seconds(records: list[dict]) -> float:
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records[1:], records[2:])]
    return statistics.median(times)


def timing(tmp: Path, steps: int) -> None:
    ratios = {}
    for label, nproc, batch in (("1 process", 1, "8"), ("FSDP 4", 4, "2")):
        figures: dict[str, list[tuple[float, int]]] = {"AdamW": [], "Muon": []}
        for repeat in range(2):
            for name in figures:
                records = run(tmp / f"{label}-{name}-{repeat}".replace(" ", "_"), nproc, "--optimizer.name", name,
                              "--training.steps", str(steps), "--training.seq_len", "256",
                              "--training.local_batch_size", batch, "--training.global_batch_size", "8")
                state = next(r["optimizer_bytes"] for r in records if "optimizer_bytes" in r)  # logged once
                figures[name].append((step_seconds(records), state))
        for name, runs in figures.items():
            print(f"{label:10s} {name:6s} step {statistics.median(s for s, _ in runs) * 1e3:8.1f} ms   optimizer "
                  f"state {runs[0][1] / 2**20:6.2f} MiB a rank")
        ratios[label] = (statistics.median(s for s, _ in figures["Muon"]) /
                         statistics.median(s for s, _ in figures["AdamW"]))
    print(f"Muon/AdamW step time: {ratios['1 process']:.2f} on 1 process, {ratios['FSDP 4']:.2f} on FSDP 4")


def sweep(tmp: Path, steps: int, lrs: list[str]) -> None:
    best = {}
    for name in ("AdamW", "Muon"):
        for lr in lrs:
            records = run(tmp / f"sweep-{name}-{lr}", 1, "--optimizer.name", name, "--optimizer.lr", lr,
                          "--training.steps", str(steps), "--training.seq_len", "128", "--training.local_batch_size",
                          "4")
            loss = statistics.mean(r["loss"] for r in records[-5:])
            print(f"sweep {name:6s} lr {lr:>6s}: loss {loss:.4f} (mean of steps {steps - 4}-{steps})")
            if name not in best or loss < best[name][0]:
                best[name] = (loss, lr)
    print(f"best loss: AdamW {best['AdamW'][0]:.4f} (lr {best['AdamW'][1]}), Muon {best['Muon'][0]:.4f} "
          f"(lr {best['Muon'][1]})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="steps of each timed run")
    p.add_argument("--sweep_steps", type=int, default=40, help="steps of each sweep run")
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2", help="the sweep's lrs, comma-separated")
    p.add_argument("--skip_sweep", action="store_true")
    p.add_argument("--skip_timing", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_timing:
            timing(Path(tmp), args.steps)
        if not args.skip_sweep:
            sweep(Path(tmp), args.sweep_steps, args.lrs.split(","))


if __name__ == "__main__":
    main()
