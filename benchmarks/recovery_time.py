"""Seconds from a fault to the next completed step, on this machine's CPU processes.

    python benchmarks/recovery_time.py

1. A dead worker: `MAX_RESTARTS=1 NGPU=4 ./run_train.sh` (the debug model, checkpoints every 5 steps), local rank 1
   SIGKILLed once step 12 is logged; torchrun restarts the group, which resumes from step-10.
2. An elastic job (`--nnodes 1:2`, 2 processes per agent, the tests' tiny model and rendezvous settings,
   tests/multiprocess/test_multinode.py): a second agent joins (2 -> 4 processes), then its launcher is SIGKILLed
   (4 -> 2). Times run from the second agent's launch, and from the SIGKILL, to the next step logged.
Each figure includes starting the new workers (imports, mesh, model, checkpoint load). The last line holds all three.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The jobs are the multi-process tests' (tests/multiprocess/launch.py: agents, gate, process trees), loaded from
# their file: tests/ is not part of the installed package.
_spec = importlib.util.spec_from_file_location("launch", ROOT / "tests" / "multiprocess" / "launch.py")
sys.modules["launch"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sys.modules["launch"])
from launch import (CHECKPOINTED, COMMON, GATE, STEPS, agent, descendants, free_port, kill_tree,  # noqa: E402
                    logged, read_metrics, resumes, train_argv, wait_until)


def stepped_since_resume(folder: Path) -> bool:
    """Whether a resumed run has logged a step: the resume cut the steps past its checkpoint from metrics.jsonl."""
    return bool(resumes(folder)) and read_metrics(folder)[-1]["step"] > resumes(folder)[-1]["step"]


def dead_worker(folder: Path) -> float:
    env = {**os.environ, "MAX_RESTARTS": "1", "NGPU": "4", "PYTHON": sys.executable}
    job = subprocess.Popen(["./run_train.sh", "--job.dump_folder", str(folder), "--checkpoint.enable",
                            "--checkpoint.interval", "5", "--training.steps", "14"], cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: logged(folder) >= 12, "step 12", job)
        worker = sorted(descendants(job.pid))[-3]  # torchrun's workers, spawned in local-rank order: rank 1
        start = time.perf_counter()
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: stepped_since_resume(folder), "a step after the restart", job)
        return time.perf_counter() - start
    finally:
        kill_tree(job)


def elastic(folder: Path) -> tuple[float, float]:
    for step in (3, 6):
        (folder / f"hold-{step}").touch()
    args = (GATE, str(folder), *train_argv(folder, *COMMON, "--training.steps", str(STEPS), *CHECKPOINTED))
    port = free_port()
    a = agent("1:2", port, "bench", *args)
    b = None
    try:
        wait_until(lambda: logged(folder) >= 2, "step 2", a)
        start = time.perf_counter()
        b = agent("1:2", port, "bench", *args)
        wait_until(lambda: any(r["world_size"] == 4 for r in read_metrics(folder)), "4 processes", a, b)
        grow = time.perf_counter() - start
        wait_until(lambda: read_metrics(folder)[-1]["step"] == 5, "step 5", a, b)
        start, n = time.perf_counter(), len(resumes(folder))
        os.kill(b.pid, signal.SIGKILL)
        b.communicate()
        (folder / "hold-6").unlink()
        wait_until(lambda: len(resumes(folder)) > n and stepped_since_resume(folder), "a step on 2 processes", a)
        return grow, time.perf_counter() - start
    finally:
        for proc in (a, b):
            if proc is not None:
                kill_tree(proc)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        killed = dead_worker(Path(tmp) / "dead_worker")
        print(f"dead worker: SIGKILL -> next step {killed:.1f} s")
        (Path(tmp) / "elastic").mkdir()
        grow, shrink = elastic(Path(tmp) / "elastic")
        print(f"elastic: agent joins -> first step on 4 processes {grow:.1f} s; agent SIGKILLed -> next step on 2 "
              f"{shrink:.1f} s")
    print(f"recovery: dead worker {killed:.1f} s, grow {grow:.1f} s, shrink {shrink:.1f} s")
