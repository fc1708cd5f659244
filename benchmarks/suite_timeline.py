"""Where the suite's wall time goes: the machine's busy cores, sampled every second, against the test running then.

    PYTHONPATH=benchmarks python -m pytest -q -p suite_timeline [pytest's arguments]
    python benchmarks/suite_timeline.py [TIMELINE_JSONL]     # the summary of a finished run

A pytest plugin (loaded with -p) that appends {"t", "busy", "test"} to $SUITE_TIMELINE (default
/tmp/suite_timeline.jsonl) every second: `busy` counts the cores the whole machine kept busy in that second (from
/proc/stat, so the torchrun jobs a test starts count too), `test` is the test pytest was in; and after each test
{"test", "wall", "cpu"}: its seconds, and the CPU seconds of pytest's process and of the processes it waited for
meanwhile (a job started in the background counts where it is waited for). Run as a script, it prints each stretch of
consecutive seconds in one test file with its mean busy cores, the idle core-seconds per file, largest first (what a
change to the suite's order or packing could win: docs/testing.md, "Where the suite's time goes"), then the tests
that cost the most CPU. Linux only.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from collections import defaultdict

import pytest

PATH = os.environ.get("SUITE_TIMELINE", "/tmp/suite_timeline.jsonl")
_current, _out = [""], []


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


def _cpu_s() -> float:
    """CPU seconds of this process and of its children waited for so far."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                        resource.RUSAGE_CHILDREN)))


def pytest_configure(config) -> None:
    _out.append(open(PATH, "w"))
    threading.Thread(target=_sample, args=(_out[0],), name="suite timeline", daemon=True).start()


def pytest_runtest_logstart(nodeid, location) -> None:
    _current[0] = nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start, cpu = time.time(), _cpu_s()
    yield
    _out[0].write(json.dumps({"test": item.nodeid, "wall": time.time() - start, "cpu": _cpu_s() - cpu}) + "\n")



def summary(rows: list[dict], cores: int) -> str:
    stretches, idle = [], defaultdict(float)
    tests = sorted((r for r in rows if "cpu" in r), key=lambda r: -r["cpu"])
    for row in (r for r in rows if "busy" in r):
        file = row["test"].split("::")[0] or "(collecting)"
        if not stretches or stretches[-1][0] != file:
            stretches.append([file, 0, 0.0])
        stretches[-1][1] += 1
        stretches[-1][2] += row["busy"]
        idle[file] += cores - row["busy"]
    busy = [r["busy"] for r in rows if "busy" in r]
    lines = [f"{len(busy)} s, {sum(busy) / max(1, len(busy)):.2f} of {cores} cores busy on average",
             "", "seconds  busy  file (each stretch, in order)"]
    lines += [f"{n:7d}  {b / n:4.2f}  {file}" for file, n, b in stretches]
    lines += ["", "idle core-s  file"]
    lines += [f"{s:11.0f}  {file}" for file, s in sorted(idle.items(), key=lambda kv: -kv[1])]
    lines += ["", f"CPU s  wall s  test (the {min(30, len(tests))} costliest of {len(tests)}, "
                  f"{sum(r['cpu'] for r in tests):.0f} CPU s in all)"]
    lines += [f"{r['cpu']:5.1f}  {r['wall']:6.1f}  {r['test']}" for r in tests[:30]]
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else PATH) as f:
        print(summary([json.loads(line) for line in f], os.cpu_count()))
