"""The shared helper of the multi-process tests: launch real torchrun jobs of train.py on the CPU and read back
what they wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "assets" / "tiny.toml"


def torchrun(nproc: int, dump_folder: Path, *overrides: str, config: Path = TINY, timeout: float = 300,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run train.py on `nproc` local gloo processes; raise with the output's tail if it fails and `check`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "train.py"), "--job.config_file", str(config), "--job.dump_folder", str(dump_folder),
           *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


def read_metrics(dump_folder: Path) -> list[dict]:
    with open(Path(dump_folder) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def losses(dump_folder: Path) -> dict[int, float]:
    """step -> loss; a resumed run's later line for a step wins."""
    return {m["step"]: m["loss"] for m in read_metrics(dump_folder) if "loss" in m}
