"""What replica groups (fault_tolerance.enable, torchft) cost, on this machine's CPU processes.

    python benchmarks/replica_groups.py [--steps 30]

1. Without a fault, per step: the debug model on one process, plain and as a run of one replica group (the quorum,
   the commit vote and the all-reduce across groups, with no peer: what every step pays whatever the model), then two
   groups of one process against one job of two FSDP processes with the same global batch (each pays its own
   gradient reduction: the groups one all-reduce across groups, FSDP its reduce-scatter), and one of those two groups
   alone, as while the other is away: in exact mode it trains the whole global batch, in fast mode its own half.
2. A fault, side by side (fault()): a process SIGKILLed at the start of step 10 under two replica groups, and under
   one job that torchrun restarts and that resumes from its newest checkpoint: the time to reach step 20 against the
   same run uninterrupted, with torchft's default heartbeat (5 s).
Each job's step time is the median of its steps' records after the first two (elapsed_s between records). The last
line holds every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("launch", ROOT / "tests" / "multiprocess" / "launch.py")
sys.modules["launch"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sys.modules["launch"])
from launch import GATE, TINY, kill_tree, torchrun_cmd, train_argv  # noqa: E402

os.environ.setdefault("RUST_LOG", "error")  # the lighthouse's Rust part logs each quorum otherwise
from torchft._torchft import LighthouseServer  # noqa: E402

DEBUG = ROOT / "train_configs" / "debug_model.toml"
PLAIN = ("--parallelism.tensor_parallel_degree", "1", "--no-validation.enable", "--metrics.log_freq", "1")


def step_seconds(folder: Path) -> float:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in records if "loss" in r]
    return statistics.median(b - a for a, b in zip(elapsed[2:], elapsed[3:]))


def start(nproc: int, folder: Path, *args: str, config: Path = DEBUG, script: Path = ROOT / "train.py",
          restarts: int = 0) -> subprocess.Popen:
    cmd, env = torchrun_cmd(nproc, script, *args, *train_argv(folder, config=config),
                            launcher=("--standalone", "--max-restarts", str(restarts)))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def groups(n: int, lighthouse: str, *args: str) -> tuple[str, ...]:
    return ("--fault_tolerance.enable", "--fault_tolerance.group_size", str(n), "--fault_tolerance.lighthouse",
            lighthouse, "--fault_tolerance.groups_per_machine", str(n), *args)


def finish(*jobs: subprocess.Popen) -> list[str]:
    try:
        outs = [j.communicate(timeout=1200)[0] for j in jobs]
    finally:
        for j in jobs:
            if j.poll() is None:
                kill_tree(j)
    for j, out in zip(jobs, outs):
        assert j.returncode == 0, out[-3000:]
    return outs


def no_fault(root: Path, steps: int) -> dict[str, float]:
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, heartbeat_timeout_ms=1000)
    try:
        common = (*PLAIN, "--training.steps", str(steps), "--training.global_batch_size", "8")
        out = {}
        finish(start(1, root / "plain", *common))
        finish(start(1, root / "one_group", *groups(1, lighthouse.address(), "--fault_tolerance.replica_id", "0"),
                     *common))
        out["1 process s/step"], out["1 group s/step"] = step_seconds(root / "plain"), step_seconds(root / "one_group")
        finish(start(2, root / "fsdp2", *common))
        finish(*(start(1, root / "two_groups", *groups(2, lighthouse.address(), "--fault_tolerance.replica_id",
                                                       str(r)), *common) for r in (0, 1)))
        out["fsdp2 s/step"], out["2 groups s/step"] = step_seconds(root / "fsdp2"), step_seconds(root / "two_groups")
        for mode in ("exact", "fast"):  # one of the two groups alone, as while the other is away
            finish(start(1, root / mode, *groups(2, lighthouse.address(), "--fault_tolerance.replica_id", "0",
                                                 "--fault_tolerance.mode", mode), *common))
            out[f"1 of 2 groups, {mode} s/step"] = step_seconds(root / mode)
        return out
    finally:
        lighthouse.shutdown()


def first_seen(folder: Path, *jobs: subprocess.Popen) -> dict[int, float]:
    """When each step's record first appeared in metrics.jsonl (polled every 20 ms while any job runs)."""
    seen, path = {}, folder / "metrics.jsonl"
    while any(j.poll() is None for j in jobs):
        if path.exists():
            for line in path.read_text().splitlines():
                if '"loss"' in line and line.endswith("}"):
                    seen.setdefault(json.loads(line)["step"], time.monotonic())
        time.sleep(0.02)
    return seen


def reach(folder: Path, *jobs: subprocess.Popen, last: int) -> float:
    """Seconds from the first step's record to step `last`'s (the run's start-up left out: it is the same with or
    without a fault)."""
    seen = first_seen(folder, *jobs)
    finish(*jobs)
    return seen[last] - seen[1]


def fault(root: Path, steps: int = 20, die: int = 10, heartbeat_ms: int = 5000) -> dict[str, float]:
    """What one fault costs: the time to reach step `steps` with a process SIGKILLed at the start of step `die`,
    against the same run uninterrupted, under both: two replica groups of one process each (exact mode: the survivor
    trains the whole batch until the killed group, restarted by its torchrun, heals and rejoins), and one FSDP job of
    two processes that torchrun restarts and that resumes from its checkpoint of step 5. The tests' tiny model,
    global batch 8, 2 CPU processes in all; the lighthouse drops a silent group after `heartbeat_ms` (torchft's
    default: 5 s)."""
    common = ("--training.steps", str(steps), "--training.global_batch_size", "8", "--metrics.log_freq", "1")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, heartbeat_timeout_ms=heartbeat_ms)
    out = {}
    try:
        for name, death in (("clean", ()), ("fault", ("0", str(die)))):
            folder = root / f"groups_{name}"
            folder.mkdir()
            jobs = [start(1, folder, str(folder), *(death if r == 1 else ()),
                          *groups(2, lighthouse.address(), "--fault_tolerance.replica_id", str(r)), *common,
                          config=TINY, script=GATE, restarts=1) for r in (0, 1)]
            out[f"groups {name}: s to step {steps}"] = reach(folder, *jobs, last=steps)
    finally:
        lighthouse.shutdown()
    for name, death in (("clean", ()), ("fault", ("1", str(die)))):
        folder = root / f"restart_{name}"
        folder.mkdir()
        job = start(2, folder, str(folder), *death, *common, "--checkpoint.enable", "--checkpoint.interval", "5",
                    config=TINY, script=GATE, restarts=1)
        out[f"restart {name}: s to step {steps}"] = reach(folder, job, last=steps)
    for way in ("groups", "restart"):
        out[f"{way}: a fault costs s"] = out[f"{way} fault: s to step {steps}"] - out[f"{way} clean: s to step {steps}"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        figures = {**no_fault(Path(tmp), args.steps), **fault(Path(tmp))}
        for k, v in figures.items():
            print(f"{k:>32}: {v:.4f}")
        one, plain = figures["1 group s/step"], figures["1 process s/step"]
        print(f"quorum overhead {100 * (one / plain - 1):+.1f}% of a step ({1000 * (one - plain):+.1f} ms), "
              f"2 groups / fsdp2 {figures['2 groups s/step'] / figures['fsdp2 s/step']:.3f}, one group of the two "
              f"alone / both: exact {figures['1 of 2 groups, exact s/step'] / figures['2 groups s/step']:.2f}, fast "
              f"{figures['1 of 2 groups, fast s/step'] / figures['2 groups s/step']:.2f}; a fault costs "
              f"{figures['groups: a fault costs s']:.2f} s with replica groups, "
              f"{figures['restart: a fault costs s']:.2f} s with restart + resume "
              f"({time.perf_counter() - t0:.0f} s in all)")

if __name__ == "__main__":
    main()
