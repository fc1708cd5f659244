"""Time from launching `./run_train.sh` to its `step: 1` line, as a user sees it.

    python benchmarks/time_to_first_step.py [--repo PATH] [--runs N] [-- extra run_train.sh arguments]

Runs the README's main job (the debug model on 4 CPU processes, or all GPUs) N times, each stopped once step 1 is
logged, and prints each time and the median. `--repo` times another checkout, e.g. an older commit in a
`git worktree`, so two versions can be compared side by side on one machine. The first run of a checkout may also
fill the tokenized-corpus cache (datasets.cached_tokens); set TORCHTITAN_LITE_CACHE to an empty folder to time a
cold start. The last line is `time to first step: S s (median of N)`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def time_once(repo: Path, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as dump:
        cmd = ["./run_train.sh", "--job.dump_folder", dump, *extra]
        env = {**os.environ, "PYTHON": sys.executable}
        start = time.perf_counter()
        # A session of its own, so the whole job (torchrun and its workers) can be stopped once step 1 is seen.
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            for line in proc.stdout:
                if "step: 1/" in line or "step: 1 " in line:  # `step: 1/N` since 2026-11-27
                    return time.perf_counter() - start
            raise SystemExit(f"{repo}: the job ended without a step 1 (exit code {proc.wait()})")
        finally:
            with contextlib.suppress(ProcessLookupError):  # a job that ended by itself
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            # torchrun stops its workers on SIGTERM; any left over (sessions of their own) are found by name.
            subprocess.run(["pkill", "-f", "--", f"--job.dump_folder {dump}"], check=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, default=ROOT, help="checkout whose run_train.sh to time")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("extra", nargs="*", help="run_train.sh arguments (after --)")
    args = p.parse_args()
    times = []
    for i in range(args.runs):
        times.append(time_once(args.repo.resolve(), args.extra))
        print(f"run {i + 1}: {times[-1]:.1f} s", flush=True)
    print(f"time to first step: {statistics.median(times):.1f} s (median of {args.runs})")


if __name__ == "__main__":
    main()
