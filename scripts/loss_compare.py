"""Compare two training runs' loss curves and gradient norms step by step.

    python scripts/loss_compare.py outputs/run_a outputs/run_b --tolerance 0
    python scripts/loss_compare.py --run_a "--training.steps 20" \
        --run_b "--training.steps 20 --parallelism.tensor_parallel_degree 2" --ngpu 4

The loss alone is a blind spot: AdamW divides each update by the root of its own running mean square, so a gradient
scaled by a constant (a reduction that forgot to divide by the data-parallel degree) leaves the curve almost where
it was while the gradient norm moves by that factor. So the grad norm is compared too, relative to run A's.

Runs trained first (--run_a, --run_b) show each step they log on stderr as they train (`run_a: step: 3/10  loss:
...`); stdout holds the comparison alone.

Exit status: 0 when both agree within tolerance, 1 when either does not, 2 on bad input or a failed run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan_lite.runtime.run_history import HistoryError, read_metrics  # needs no torch: starts at once

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent  # repo root: where run_train.sh and train_configs/ live

GRAD_NORM = "grad_norm"


class InputError(Exception):
    """A problem with what the user gave us; main() turns it into a message and exit status 2."""


def read_curve(path: str | os.PathLike, key: str = "loss") -> dict[int, float]:
    """{step: value} from a metrics.jsonl file or a dump folder holding one.

    Read as the trainer's one run's history (torchtitan_lite/runtime/run_history.py): a resume record at step S drops the
    records past S before it, and a step going back without one (two runs spliced in one file) is an input error.
    """
    return read_curves(path, (key,))[key]


def read_curves(path: str | os.PathLike, keys: tuple[str, ...]) -> dict[str, dict[int, float]]:
    """read_curve of several keys, reading the file once: {key: {step: value}}. A key ending in "/" stands for every
    key it begins (a mixture's "loss/" is loss/NAME of each source)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        records = read_metrics(path)
    except HistoryError as e:
        raise InputError(str(e)) from None
    curves: dict[str, dict[int, float]] = {key: {} for key in keys if not key.endswith("/")}
    prefixes = tuple(key for key in keys if key.endswith("/"))
    for record in records:
        # A record may lack a key (val_loss is logged every validation.freq steps): that step is not on its curve.
        found = [k for k in record if k in curves or (prefixes and k.startswith(prefixes))]
        for key in (k for k in found if record[k] is not None):
            try:
                curves.setdefault(key, {})[record["step"]] = float(record[key])
            except (TypeError, ValueError):
                raise InputError(f"{path}: step {record['step']}: {key} is not a number") from None
    return curves


@dataclass
class Result:
    rows: list[tuple[int, float, float, float]]  # (step, a, b, b - a) for steps both runs logged
    max_abs: float
    max_abs_step: int | None
    max_rel: float
    only_a: list[int] = field(default_factory=list)
    only_b: list[int] = field(default_factory=list)
    max_rel_step: int | None = None

    def over(self, tolerance: float, relative: bool) -> list[int]:
        """The steps whose difference (relative to A's value, or absolute) exceeds `tolerance`."""
        return [s for s, va, _, d in self.rows if (_rel(va, d) if relative else abs(d)) > tolerance]


def _diff(a: float, b: float) -> float:
    # NaN compares false to everything, so a NaN on one side would slip past a tolerance check: it counts as an
    # infinite difference instead. Equal values (inf == inf included) and NaN on both sides are no difference.
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    d = b - a
    return math.inf if math.isnan(d) else d


def _rel(a: float, d: float) -> float:
    """|d| relative to |a|; a difference from a zero or non-finite value is infinitely large."""
    if d == 0:
        return 0.0
    return abs(d) / abs(a) if math.isfinite(a) and a != 0 else math.inf


def compare(a: dict[int, float], b: dict[int, float]) -> Result:
    common = sorted(a.keys() & b.keys())
    rows = [(s, a[s], b[s], _diff(a[s], b[s])) for s in common]
    max_abs, max_abs_step, max_rel, max_rel_step = 0.0, None, 0.0, None
    for step, va, _, d in rows:
        if max_abs_step is None or abs(d) > max_abs:
            max_abs, max_abs_step = abs(d), step
        if max_rel_step is None or _rel(va, d) > max_rel:
            max_rel, max_rel_step = _rel(va, d), step
    return Result(rows, max_abs, max_abs_step, max_rel, sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys()),
                  max_rel_step)


def run_training(overrides: str, dump: Path, config: str | None, ngpu: int | None) -> Path:
    """Train once through ./run_train.sh into `dump`; return its metrics file."""
    # A leftover checkpoint would make the run resume instead of start, and leftover metrics would mix in.
    if dump.exists() and any(dump.iterdir()):
        raise InputError(f"{dump} is not empty; pick a fresh --workdir")
    dump.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if config:
        env["CONFIG_FILE"] = str(Path(config).resolve())  # the run's cwd is the repo root, not ours
    if ngpu:
        env["NGPU"] = str(ngpu)
    if not (ROOT / "run_train.sh").is_file():
        raise InputError(f"{ROOT / 'run_train.sh'} not found")
    cmd = [str(ROOT / "run_train.sh"), *shlex.split(overrides), "--job.dump_folder", str(dump)]
    log = dump.parent / f"{dump.name}.log"
    print(f"running {dump.name}: {shlex.join(cmd)}  (log: {log})", flush=True)
    with open(log, "w") as f, Progress(f"run_{dump.name}", dump):
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-20:]
        raise InputError(f"run {dump.name} failed with exit status {rc}; last lines of {log}:\n" + "\n".join(tail))
    return dump / "metrics.jsonl"


class Progress:
    """While a run trains, one line on stderr per step it logs (stdout stays the comparison's): `run_a: step: 3/10
    loss: 7.9878 ...`, read from the run's metrics.jsonl as rank 0 appends to it, so that a run of minutes shows where
    it is. A thread polls the file: the run's own output goes to its log, whose format this does not depend on."""

    POLL_S = 0.5

    def __init__(self, name: str, dump: Path):
        self.name, self.dump, self.read, self.total = name, dump, 0, ""
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _watch(self) -> None:
        while not self.stop.wait(self.POLL_S):
            self.report()
        self.report()  # what the run wrote last

    def report(self) -> None:
        try:
            with open(self.dump / "metrics.jsonl", "rb") as f:
                f.seek(self.read)
                text = f.read()
        except OSError:  # not written yet
            return
        done = text.rfind(b"\n") + 1  # whole lines only: the writer may be mid-line
        self.read += done
        for line in text[:done].decode(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "step" in record and ("loss" in record or "val_loss" in record):
                print(f"{self.name}: {self._line(record)}", file=sys.stderr, flush=True)

    def _line(self, record: dict) -> str:
        if not self.total:  # config.toml is written before the first step
            try:
                self.total = f"/{tomllib.loads((self.dump / 'config.toml').read_text())['training']['steps']}"
            except (OSError, ValueError, KeyError):
                pass
        fields = [f"step: {record['step']}{self.total}"]
        fields += [f"{key}: {record[key]:{fmt}}" for key, fmt in (("loss", ".4f"), ("val_loss", ".4f"),
                   ("grad_norm", ".4f"), ("tps", ",.0f"), ("elapsed_s", ".1f")) if isinstance(record.get(key), float)]
        return "  ".join(fields)


def plot(result: Result, key: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # write a file; never needs a display
    import matplotlib.pyplot as plt

    steps = [r[0] for r in result.rows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    top.plot(steps, [r[1] for r in result.rows], label="A")
    top.plot(steps, [r[2] for r in result.rows], label="B", linestyle="--")
    top.set_ylabel(key)
    top.legend()
    bottom.plot(steps, [r[3] for r in result.rows], color="tab:red")
    bottom.set_ylabel(f"{key} B - A")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="A resumed run's steps after its resume record replace those it logged past its checkpoint before; "
        "a step going back without one (two runs in one file) is bad input. Steps only one run logged are listed "
        "and not compared. Exit status: 0 within tolerance, 1 above it, 2 on bad input or a failed run.",
    )
    p.add_argument("a", nargs="?", help="run A: a metrics.jsonl file or a dump folder holding one")
    p.add_argument("b", nargs="?", help="run B: same")
    p.add_argument("--key", default="loss", help="metric to compare, e.g. val_loss or grad_norm (default: loss)")
    p.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest |B - A| of --key still accepted (default 1e-5: absorbs float reduction-order noise "
                   "between parallelisms; use 0 to require bitwise-equal curves)")
    p.add_argument("--grad_norm_tolerance", type=float, metavar="R",
                   help="largest |B - A| / |A| of the grad norm still accepted (default: the --tolerance value, so "
                   "1e-5 relative for a parity check and 0, bitwise, with --tolerance 0)")
    p.add_argument("--no_grad_norm", action="store_true", help="compare --key alone, not the grad norm as well")
    p.add_argument("--steps", type=int, help="compare only steps <= N")
    p.add_argument("--plot", metavar="OUT.png", help="save both curves and their difference (needs matplotlib)")
    g = p.add_argument_group("train both runs first, through ./run_train.sh (instead of A and B); each logged step "
                             "shows on stderr as it trains")
    g.add_argument("--run_a", metavar="OVERRIDES", help='config overrides of run A, e.g. "--training.steps 10" (run from the repo root)')
    g.add_argument("--run_b", metavar="OVERRIDES", help="config overrides of run B")
    g.add_argument("--config", help="CONFIG_FILE for both runs (default: run_train.sh's)")
    g.add_argument("--ngpu", type=int, help="NGPU for run A, and for B unless --ngpu_b")
    g.add_argument("--ngpu_b", type=int, help="NGPU for run B")
    g.add_argument("--workdir", help="where the runs' dump folders a/, b/ and logs go (default: a new temp dir)")
    args = p.parse_args(argv)
    training = args.run_a is not None or args.run_b is not None
    if training and (args.a or args.b or args.run_a is None or args.run_b is None):
        p.error("give either A and B, or both --run_a and --run_b")
    if not training and not (args.a and args.b):
        p.error("give two runs to compare: A and B (metrics.jsonl files or dump folders)")
    if args.grad_norm_tolerance is None:
        args.grad_norm_tolerance = args.tolerance
    for name in ("tolerance", "grad_norm_tolerance"):
        if not getattr(args, name) >= 0:  # NaN too: it would accept every difference
            p.error(f"--{name} must be a number >= 0, not {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        # Fail before a possibly long training run, not after it.
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 2
    try:
        if args.run_a is not None:
            work = Path(args.workdir or tempfile.mkdtemp(prefix="loss_compare_")).resolve()
            args.a = run_training(args.run_a, work / "a", args.config, args.ngpu)
            args.b = run_training(args.run_b, work / "b", args.config, args.ngpu_b or args.ngpu)
        keys = (args.key,) if args.no_grad_norm or args.key == GRAD_NORM else (args.key, GRAD_NORM)
        a, b = read_curves(args.a, keys), read_curves(args.b, keys)
        if args.steps is not None:
            for curves in (a, b):
                curves.update({k: {s: v for s, v in c.items() if s <= args.steps} for k, c in curves.items()})
        result = compare(a[args.key], b[args.key])
        if not result.rows:
            raise InputError(f"no step has a {args.key!r} value in both {args.a} and {args.b}")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # (name, result, tolerance, relative) of each metric compared.
    checks = [(args.key, result, args.tolerance, False)]
    if GRAD_NORM in keys:
        norms = compare(a[GRAD_NORM], b[GRAD_NORM])
        if norms.rows:
            checks.append((GRAD_NORM, norms, args.grad_norm_tolerance, True))
        else:
            lacking = [name for name, run in (("A", a), ("B", b)) if not run[GRAD_NORM]]
            why = f"run {' and '.join(lacking)} logged none" if lacking else "no step has one in both runs"
            print(f"note: grad_norm not compared ({why}): {args.key} alone decides")
    print_table(checks)
    for name, steps in (("A", result.only_a), ("B", result.only_b)):
        if steps:
            print(f"warning: steps only in {name}, not compared: {', '.join(map(str, steps))}")
    print(f"max abs diff: {result.max_abs:.3e} at step {result.max_abs_step}")
    print(f"max rel diff: {result.max_rel:.3e}")
    if len(checks) > 1:
        print(f"{GRAD_NORM} max rel diff: {norms.max_rel:.3e} at step {norms.max_rel_step}")
    if args.plot:
        plot(result, args.key, args.plot)
        print(f"plot written to {args.plot}")
    return verdict(checks)


def print_table(checks: list[tuple[str, Result, float, bool]]) -> None:
    """One row per step of the first metric, the grad norm's values and relative difference beside it."""
    (key, result, _, _), norms = checks[0], (checks[1][1] if len(checks) > 1 else None)
    header = f"{'step':>6}  {key + ' A':>16}  {key + ' B':>16}  {'diff':>10}"
    print(header + (f"  {GRAD_NORM + ' A':>16}  {GRAD_NORM + ' B':>16}  {'rel diff':>10}" if norms else ""))
    by_step = {s: (va, vb, _rel(va, d)) for s, va, vb, d in norms.rows} if norms else {}
    for step, va, vb, d in result.rows:
        row = f"{step:>6}  {va:>16.8f}  {vb:>16.8f}  {d:>10.3e}"
        if step in by_step:
            row += "  {:>16.8f}  {:>16.8f}  {:>10.3e}".format(*by_step[step])
        print(row)


def verdict(checks: list[tuple[str, Result, float, bool]]) -> int:
    """Prints which metrics differ and from which step; the exit status: 0 when none does, else 1."""
    differ = {}  # name -> first step above its tolerance
    for name, result, tolerance, relative in checks:
        over = result.over(tolerance, relative)
        kind = "rel" if relative else "abs"
        if over:
            differ[name] = over[0]
            print(f"{name}: FAIL, {kind} diff > {tolerance:g} at {len(over)} of {len(result.rows)} steps, first at "
                  f"step {over[0]}")
        else:
            print(f"{name}: OK, max {kind} diff <= {tolerance:g}")
    if not differ:
        print(f"OK: {' and '.join(name for name, *_ in checks)} within tolerance")
        return 0
    if len(differ) == 1:
        print("FAIL: {} differs from step {}".format(*differ.popitem()))
    else:
        where = ", ".join(f"{name} from step {step}" for name, step in differ.items())
        print(f"FAIL: {' and '.join(differ)} differ ({where})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
