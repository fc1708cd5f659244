"""Eager against compiled blocks: the step time of the same job, side by side on this machine.

    python benchmarks/compile_speedup.py [--nproc 4] [--rounds 2] [--steps 16] [--warmup 4] [-- overrides...]

Runs `./run_train.sh` (the debug model; on 4 CPU processes its TP 2 x FSDP 2 mesh) as is and with
`--compile.enable`, alternating eager and compiled jobs round by round so that load on a shared machine hits both
alike. A step's time comes from metrics.jsonl (the tokens of each step over its tokens/s, per device), the first
--warmup steps left out: they include compilation (inductor's C++ kernels), which the job pays once. Both jobs must
give the same losses to within 1e-4 (they train the same model on the same data), so the ratio compares equal work.

Prints each round's median step time of each side, then `compiled/eager step speed: R` (eager time / compiled time
over all rounds' steps: R > 1 when compiled is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from torchtitan_lite.runtime.run_history import read_metrics  # noqa: E402


def step_times(nproc: int, steps: int, warmup: int, extra: list[str]) -> tuple[list[float], list[float]]:
    """(seconds per step after warmup, losses) of one ./run_train.sh job."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = ["./run_train.sh", "--job.dump_folder", dump, "--training.steps", str(steps), "--metrics.log_freq", "1",
               "--no-validation.enable", "--no-checkpoint.enable", *extra]
        env = {**os.environ, "PYTHON": sys.executable, "NGPU": str(nproc)}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        records = read_metrics(dump)
    times, previous = [], None
    for r in records:
        if previous is not None and r["step"] > warmup:
            times.append((r["tokens_seen"] - previous["tokens_seen"]) / r["world_size"] / r["tps"])
        previous = r
    return times, [r["loss"] for r in records]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="processes (NGPU)")
    p.add_argument("--rounds", type=int, default=2, help="eager and compiled jobs, alternating")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of each job's timing")
    p.add_argument("extra", nargs="*", help="config overrides for both jobs (after --)")
    args = p.parse_args()
    all_times = {"eager": [], "compiled": []}
    for r in range(args.rounds):
        row, curves = [], {}
        for name, flags in (("eager", []), ("compiled", ["--compile.enable"])):
            times, curves[name] = step_times(args.nproc, args.steps, args.warmup, [*args.extra, *flags])
            all_times[name] += times
            row.append(f"{name} {1000 * statistics.median(times):.1f} ms/step")
        diff = max(abs(a - b) for a, b in zip(curves["eager"], curves["compiled"]))
        if diff > 1e-4:
            raise SystemExit(f"eager and compiled losses differ by {diff:.2e}: not the same training")
        print(f"round {r + 1}: {', '.join(row)} (losses within {diff:.1e})", flush=True)
    eager, compiled = (statistics.median(all_times[k]) for k in ("eager", "compiled"))
    print(f"median over {args.rounds} rounds: eager {1000 * eager:.1f} ms/step, compiled {1000 * compiled:.1f} ms/step")
    print(f"compiled/eager step speed: {eager / compiled:.3f}")


if __name__ == "__main__":
    main()
