"""Training curves of one or more runs as one picture: loss (and val_loss, multi-token prediction's mtp_loss), lr,
grad norm and tokens/s; for a mixture of experts its load and router losses; and for a data mixture each source's
loss (and val_loss) in a panel of its own.

    python scripts/plot_metrics.py outputs/run_a outputs/run_b --out curves.png [--log_loss]

Four panels answer at a glance what metrics.jsonl answers only to patient reading: did the loss go down or diverge,
did warmup and decay happen, did a gradient spike, did throughput drop. Runs are overlaid in one colour each, named
by their dump folder, so two settings compare by eye; loss_compare.py compares them step by step, in numbers.

Each RUN is a metrics.jsonl file or a dump folder holding one, read by loss_compare.py's read_curve so both scripts
agree on a run's curve: one run's history (torchtitan_lite/runtime/run_history.py), each step once, a resumed run's record of
a step replacing any logged past its checkpoint before the resume; a file holding two runs' records (a step going
back without a resume record) is refused rather than drawn as one spliced line. Non-finite values (the grad norm of
a skipped fp16 step) are drawn as gaps rather than pulling the axis to infinity.

A mixture of experts' run (records with expert_load/<layer>, aux_loss or router_z_loss) adds a row: the load, the
busiest expert's slots over the mean in the worst layer at each step (the console's `load`; 1.0 is perfect balance),
and the auxiliary loss, the router z-loss dashed and the logits' z-loss dotted (on the right axis) where logged, before
their coefficients. A dense run's picture is as before.

matplotlib is needed by this script only, not by the trainer. Exit status: 0 when the picture is written, 1 without
matplotlib, 2 on bad input.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from loss_compare import InputError, read_curves

# (metrics.jsonl key, panel title); val_loss shares the loss panel.
PANELS = [("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "grad norm (before clipping)"),
          ("tps", "tokens/s per device")]
# A mixture of experts' row: its worst layer's load (from expert_load/<layer>), and its router losses in one panel
# (z_loss, the logits' own, beside them when logged), each in a line style of its own.
MOE_PANELS = [("load", "expert load (busiest / mean, worst layer)"),
              ("aux_loss", "auxiliary losses (before coefficients)")]
MOE_KEYS = ("expert_load/", "aux_loss", "router_z_loss")  # any of these logged: the run is a mixture of experts
LOSS_STYLES = {"aux_loss": "-", "router_z_loss": "--", "z_loss": ":"}
KEYS = ("loss", "val_loss", "lr", "grad_norm", "tps", "loss/", "val_loss/", *MOE_KEYS, "z_loss",
        "mtp_loss")  # and per source


@dataclass
class Run:
    name: str
    series: dict[str, tuple[list[int], list[float]]]  # key -> (steps ascending, one per step; values)


def load_run(path: str | os.PathLike, name: str) -> Run:
    """The series to draw for one run: per key, each step once, non-finite values as NaN."""
    series = {}
    curves = read_curves(path, KEYS)  # one reading of the file for every panel
    load: dict[int, float] = {}  # the worst layer's at each step: one line a run, as the console's `load`
    for layer in [curves.pop(k) for k in list(curves) if k.startswith("expert_load/")]:
        for step, value in layer.items():
            load[step] = max(load.get(step, value), value)
    curves["load"] = load
    for key, curve in curves.items():
        if curve:
            steps = sorted(curve)
            series[key] = (steps, [curve[s] if math.isfinite(curve[s]) else math.nan for s in steps])
    if not series:
        raise InputError(f"{path}: no record has any of {', '.join(KEYS)}")
    return Run(name, series)


def run_names(paths: list[str | os.PathLike]) -> list[str]:
    """Legend names: the dump folder's name (a file's, unless it is metrics.jsonl), with as many parent folders as
    it takes to tell the runs apart; the same run given twice gets a number."""
    parts = []
    for p in map(Path, paths):
        p = p.resolve()
        if p.is_dir():
            parts.append(p.parts)
        elif p.name == "metrics.jsonl":
            parts.append(p.parent.parts)
        else:
            parts.append((*p.parent.parts, p.stem))
    depth = [1] * len(parts)
    while True:
        names = [str(Path(*c[-d:])) for c, d in zip(parts, depth)]
        clashing = [i for i, n in enumerate(names) if names.count(n) > 1 and depth[i] < len(parts[i])]
        if not clashing:
            break
        for i in clashing:
            depth[i] += 1
    return [n if names[:i].count(n) == 0 else f"{n} ({names[:i].count(n) + 1})" for i, n in enumerate(names)]


def draw(runs: list[Run], out: str, log_loss: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")  # write a file; never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import LogFormatter

    # A mixture's runs add a panel per source: its training loss, and its validation loss dashed.
    sources = sorted({key.split("/", 1)[1] for run in runs for key in run.series if "/" in key})
    moe = any(key in run.series for run in runs for key in ("load", "aux_loss", "router_z_loss"))
    rows = 2 + moe + (len(sources) + 1) // 2
    fig, axes = plt.subplots(rows, 2, sharex=True, figsize=(12, 4 * rows), squeeze=False)
    titles = PANELS + MOE_PANELS * moe + [(f"loss/{name}", f"source {name}: loss") for name in sources]
    panels = dict(zip((key for key, _ in titles), axes.flat))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # The logits' z-loss is (log vocab)^2-sized, tens of times the router losses: on an axis of its own, the right's.
    z_axis = None
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        for key, ax in panels.items():
            if key in run.series:
                steps, values = run.series[key]
                # A lone point draws no line: give it a marker so a one-step run still shows.
                ax.plot(steps, values, color=color, label=run.name, marker="o" if len(steps) == 1 else None)
        for key in ("router_z_loss", "z_loss") if moe else ():  # beside aux_loss, in their own styles
            if key in run.series:
                steps, values = run.series[key]
                ax = panels["aux_loss"] if key != "z_loss" else z_axis or (z_axis := panels["aux_loss"].twinx())
                ax.plot(steps, values, color=color, linestyle=LOSS_STYLES[key], marker="o" if len(steps) == 1 else None)
        for val, key in [("val_loss", "loss"), *((f"val_loss/{name}", f"loss/{name}") for name in sources)]:
            if val in run.series:
                steps, values = run.series[val]
                # Few points, far apart: markers, and dashed so it is not mistaken for the training loss.
                panels[key].plot(steps, values, color=color, linestyle="--", marker="o", markersize=4)
        if "mtp_loss" in run.series:  # multi-token prediction's, before its weight: the loss's scale, dotted
            panels["loss"].plot(*run.series["mtp_loss"], color=color, linestyle=":")
    for ax in list(axes.flat)[len(titles):]:
        ax.set_visible(False)  # an odd number of sources leaves one cell empty
    for (key, title), ax in zip(titles, axes.flat):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="gray")
            ax.set_yticks([])  # an empty panel's default 0..1 scale would read as data
    if log_loss:
        panels["loss"].set_yscale("log")
        # Plain numbers: a loss spans about a decade, where the default labels read "6 x 10^0".
        panels["loss"].yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
        panels["loss"].yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    # One legend is enough, a run having one colour in every panel: an entry per run, and one for val_loss's style.
    handles, _ = panels["loss"].get_legend_handles_labels()
    if any("val_loss" in run.series for run in runs):
        handles.append(Line2D([], [], color="gray", linestyle="--", marker="o", markersize=4, label="val_loss"))
    if any("mtp_loss" in run.series for run in runs):
        handles.append(Line2D([], [], color="gray", linestyle=":", label="mtp_loss"))
    panels["loss"].legend(handles=handles, loc="best", fontsize="small")
    if logged := [key for key in LOSS_STYLES if moe and any(key in run.series for run in runs)]:
        panels["aux_loss"].legend(handles=[Line2D([], [], color="gray", linestyle=LOSS_STYLES[key], label=key + (
            " (right axis)" if key == "z_loss" else "")) for key in logged], loc="best", fontsize="small")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="A step logged again after a resume record is drawn with its later record; a step going back without "
        "one (two runs in one file) is bad input. Exit status: 0 written, 1 without matplotlib, 2 on bad input.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="a metrics.jsonl file or a dump folder holding one")
    p.add_argument("--out", required=True, metavar="FILE.png", help="where to write the picture")
    p.add_argument("--log_loss", action="store_true", help="log-scale y axis for loss and val_loss")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_metrics.py needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    try:
        runs = [load_run(path, name) for path, name in zip(args.runs, run_names(args.runs))]
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    draw(runs, args.out, args.log_loss)
    print(f"plot written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
