"""Where the suite's wall time goes: the machine's busy cores, sampled every second, against the test running then.

    PYTHONPATH=benchmarks python -m pytest -q -p suite_timeline [pytest's arguments]
    python benchmarks/suite_timeline.py [TIMELINE_JSONL]     # the summary of a finished run

A pytest plugin (loaded with -p) that appends {"t", "busy", "test"} to $SUITE_TIMELINE (default
/tmp/suite_timeline.jsonl) every second: `busy` counts the cores the whole machine kept busy in that second (from
/proc/stat, so the torchrun jobs a test starts count too), `test` is the test pytest was in. Run as a script, it prints
each stretch of consecutive seconds in one test file with its mean busy cores, then the idle core-seconds per file,
largest first: what a change to the suite's order or packing could win (docs/testing.md, "Where the suite's time
goes"). Linux only.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import defaultdict

PATH = os.environ.get("SUITE_TIMELINE", "/tmp/suite_timeline.jsonl")
_current = [""]


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot: busy is all but idle and iowait."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def _sample(out) -> None:
    busy0, total0 = _cpu_ticks()
    while True:
        time.sleep(1.0)
        busy, total = _cpu_ticks()
        cores = (busy - busy0) / max(1, total - total0) * os.cpu_count()
        out.write(json.dumps({"t": time.time(), "busy": round(cores, 3), "test": _current[0]}) + "\n")
        out.flush()
        busy0, total0 = busy, total


def pytest_configure(config) -> None:
    threading.Thread(target=_sample, args=(open(PATH, "w"),), name="suite timeline", daemon=True).start()


def pytest_runtest_logstart(nodeid, location) -> None:
    _current[0] = nodeid


def summary(rows: list[dict], cores: int) -> str:
    stretches, idle = [], defaultdict(float)
    for row in rows:
        file = row["test"].split("::")[0] or "(collecting)"
        if not stretches or stretches[-1][0] != file:
            stretches.append([file, 0, 0.0])
        stretches[-1][1] += 1
        stretches[-1][2] += row["busy"]
        idle[file] += cores - row["busy"]
    lines = [f"{len(rows)} s, {sum(r['busy'] for r in rows) / max(1, len(rows)):.2f} of {cores} cores busy on average",
             "", "seconds  busy  file (each stretch, in order)"]
    lines += [f"{n:7d}  {b / n:4.2f}  {file}" for file, n, b in stretches]
    lines += ["", "idle core-s  file"]
    lines += [f"{s:11.0f}  {file}" for file, s in sorted(idle.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else PATH) as f:
        print(summary([json.loads(line) for line in f], os.cpu_count()))
