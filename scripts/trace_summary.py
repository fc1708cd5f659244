"""One rank's trace in a few lines: the step's phases, its collectives, and the ops that took the most time.

    python scripts/trace_summary.py outputs/profile_traces/iteration_10/rank0_trace.json.gz [--top 8]

Reads the gzipped Chrome trace train.py writes with profiling.enable_profiling (docs/observability.md). Times are
inclusive wall times on the host (an op's children count in it); on a GPU the kernels are in the trace too, which
Perfetto shows on their own tracks.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict

COLLECTIVES = ("c10d::", "_c10d_functional::")
PHASES = ("data", "forward_backward", "optimizer", "validation", "log", "checkpoint", "signals")  # runtime/phases.py


def summary(path: str, top: int = 8) -> str:
    events = json.loads(gzip.open(path).read())["traceEvents"]
    phases, ops, calls, comms = {}, defaultdict(float), Counter(), Counter()
    for e in events:
        if e.get("cat") == "user_annotation" and e["name"] in PHASES:
            phases[e["name"]] = phases.get(e["name"], 0.0) + e.get("dur", 0) / 1e3
        elif e.get("cat") == "cpu_op":
            ops[e["name"]] += e.get("dur", 0) / 1e3
            calls[e["name"]] += 1
            if e["name"].startswith(COLLECTIVES):
                comms[e["name"]] += 1
    lines = ["phase                  ms"] + [f"{name:<16} {ms:>8.1f}" for name, ms in phases.items()]
    lines += ["", "collectives (calls)"] + [f"{n:>4}  {name}" for name, n in sorted(comms.items())]
    lines += ["", f"top {top} ops (inclusive ms, calls)"]
    lines += [f"{ms:>8.1f} {calls[name]:>5}  {name}" for name, ms in sorted(ops.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a rank<R>_trace.json.gz file")
    p.add_argument("--top", type=int, default=8, help="how many ops to list")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    print(summary(args.trace, args.top))


if __name__ == "__main__":
    main()
