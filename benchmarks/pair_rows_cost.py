"""The CPU the suite's generated pair rows cost (tests/multiprocess/pairs.py), as the suite makes them: the rows of
each size (2 and 4 processes) in one several_runs.py job, timed by the CPU of the job's processes.

    python benchmarks/pair_rows_cost.py CHECKOUT OUT_DIR

CHECKOUT is the repository whose rows are generated and run (this one, or `git worktree add` of another commit, to
compare two generators side by side); each run writes into OUT_DIR, and each job's log (several_runs.py: every row's
time) is OUT_DIR/jobN.log. The 8-process rows are named, not run: they hold a layout and nothing else.
"""

import resource
import sys
import time
from pathlib import Path

checkout, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
sys.path[:0] = [str(checkout), str(checkout / "tests" / "multiprocess")]

import run_table  # noqa: E402 - from CHECKOUT
from launch import COMMON, STEPS, finish_job, start_several  # noqa: E402


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


out.mkdir(parents=True, exist_ok=True)
total = 0.0
for nproc in (2, 4):
    rows = [(name, run) for name, run in run_table.PAIR_RUNS.items() if run.nproc == nproc]
    made = [(out / name, False, (*COMMON, "--training.steps", str(STEPS), *run.argv)) for name, run in rows]
    cpu, start = children_cpu(), time.time()
    finish_job(start_several(nproc, made, out / f"job{nproc}.log"), out / f"job{nproc}.log")
    cpu = children_cpu() - cpu
    total += cpu
    print(f"{nproc} processes: {len(rows)} rows, {cpu:.1f} CPU s, {time.time() - start:.1f} s", flush=True)
wide = [name for name, run in run_table.PAIR_RUNS.items() if run.nproc > 4]
print(f"in all {total:.1f} CPU s; not run: {', '.join(wide)}")
