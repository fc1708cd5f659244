"""A model of alike blocks estimated from traces of a few of them: tools/memory.py's trace costs Python time per op,
nearly all of it in the blocks, and where every block does the same, every figure of a rank is affine in the block
count. Exact or not at all: the figures of three counts must lie exactly on a line, or the estimate traces every
block as before.

When (`plan`): a model spec that says its blocks are alike (ModelSpec.blocks_alike), without a pipeline (rank 0's
stages hold a share of the blocks that depends on their count, and its schedule's warmup too), and under float8 with
filter entries only if they keep the same linears of every block (they match names, which hold the block's index).
The first and last blocks differ from the rest (the embedding's and the loss's neighbours, FSDP's last block kept
gathered), and so do the blocks that FSDP's explicit prefetch reaches from either end; selective AC's every N-th
block makes the blocks periodic. So the counts are N apart, each the model's modulo N (the blocks at the end line up
with the model's), the smallest with both edges and one period between them, the largest with three periods.

The peak needs more than its own three values. It is the highest moment of the step, and each moment is affine in
the block count with a slope of its own: the loss's holds every block's activations and the logits, the backward's
end every block's gradients, so beyond the traced counts a steeper line can overtake the one they lie on. The
tracker keeps the peak of each block's forward and of each block's backward (memory_tracker.DevicePeak). Between
the edges a block's peak is affine in its index, so the highest of them is at one end of that run: at any count the
step's peak is the highest of the segments before the blocks, of the edge blocks and of the first period beyond
each edge, each named by its distance from its end and extrapolated on its own. The largest trace checks the run
between its edges.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from torchtitan_lite.config import JobConfig
from torchtitan_lite.models.spec import Args, ModelSpec
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.quantization import float8

FIGURES = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "transient_bytes", "peak_bytes",
           "host_bytes", "mask_bytes")
Segments = dict[Any, tuple[int, int]]  # a trace's segments, in the order they ran: (bytes, transient) at each peak


class Plan(NamedTuple):
    counts: tuple[int, int, int]  # the block counts to trace
    edge: int  # blocks at either end that may differ from those between them
    every: int  # the blocks' period


def plan(cfg: JobConfig, dims: ParallelDims, args: Args, spec: ModelSpec) -> Plan | None:
    """The block counts to trace `cfg` with, or None where its figures need not be affine in the block count (or
    the model has too few blocks for three smaller counts)."""
    if not spec.blocks_alike or dims.pp > 1 or not _float8_alike(cfg, args, spec):
        return None
    ac = cfg.activation_checkpoint
    every = int(ac.selective_ac_option) if ac.mode == "selective" and ac.selective_ac_option != "op" else 1
    edge = 1 + (cfg.parallelism.fsdp_prefetch if dims.fsdp else 0)
    first = 2 * edge + every
    first += (args.n_layers - first) % every
    counts = (first, first + every, first + 2 * every)
    return Plan(counts, edge, every) if counts[-1] < args.n_layers else None


def _float8_alike(cfg: JobConfig, args: Args, spec: ModelSpec) -> bool:
    if not float8.enabled(cfg) or not cfg.float8.filter_fqns:
        return True
    with torch.device("meta"):
        model = spec.model_class(dataclasses.replace(args, n_layers=1))
    inner = [(name.removeprefix("layers.0"), m) for name, m in model.named_modules() if name.startswith("layers.0.")]
    return all(len({float8.converts(f"layers.{i}{name}", m, cfg.float8.filter_fqns) for i in range(args.n_layers)})
               == 1 for name, m in inner)


def extrapolate(traces: list[tuple[Any, Segments]], plan: Plan, n: int) -> tuple[Any, str]:
    """(the estimate of `n` blocks, "") from memory.py's (Estimate, segments) at each of plan.counts, or (None, why
    not): every figure, and the peak of every segment that may hold the step's, must lie exactly on a line."""
    figures = {}
    for name in FIGURES:
        figures[name] = _at(n, plan.counts, [getattr(estimate, name) for estimate, _ in traces])
        if figures[name] is None:
            return None, f"{name} is not affine in the block count"
    for estimate, segments in traces:  # the segments account for the step's peak, to the byte
        if _highest(list(segments.values())) != (estimate.peak_bytes, estimate.transient_bytes):
            return None, f"the segments' peaks miss the step's with {estimate.traced[0]} blocks"
    if not _run_is_affine(traces[-1][1], plan.counts[-1], plan):
        return None, "the blocks between the edges differ by more than their index"
    keyed = [_keyed(segments, count, plan) for (_, segments), count in zip(traces, plan.counts)]
    if any(k.keys() != keyed[-1].keys() for k in keyed):
        return None, "the segments differ between block counts"
    candidates = []
    for key in keyed[-1]:  # in the order they ran, as at any larger count
        at_n = [_at(n, plan.counts, [k[key][i] for k in keyed]) for i in (0, 1)]
        if None in at_n:
            return None, f"the peak of {_name(key)} is not affine in the block count"
        candidates.append(tuple(at_n))
    figures["peak_bytes"], figures["transient_bytes"] = _highest(candidates)
    return dataclasses.replace(traces[0][0], **figures, traced=plan.counts), ""


def _keyed(segments: Segments, count: int, plan: Plan) -> Segments:
    """The segments that may hold the peak at any count, each by a key that names it at every count: the one before
    the blocks, and the blocks' within `edge + every` of either end, by their distance from it."""
    reach = plan.edge + plan.every
    out = {}
    for segment, value in segments.items():
        if segment is None:
            out[segment] = value
            continue
        phase, i = segment
        if i < reach:
            out[phase, "first", i] = value
        if count - 1 - i < reach:
            out[phase, "last", count - 1 - i] = value
    return out


def _run_is_affine(segments: Segments, count: int, plan: Plan) -> bool:
    """Whether the blocks between the edges peak affinely in their index, each phase of the period on its own."""
    for phase in ("forward", "backward"):
        for start in range(plan.edge, plan.edge + plan.every):
            run = [segments.get((phase, i)) for i in range(start, count - plan.edge, plan.every)]
            if None in run or not all(_on_a_line([v[i] for v in run]) for i in (0, 1)):
                return False
    return True


def _on_a_line(values: list[int]) -> bool:
    return all(b - a == values[1] - values[0] for a, b in zip(values, values[1:]))


def _at(n: int, counts: tuple[int, ...], values: list[int]) -> int | None:
    """The value at `n` of the line through the points (counts, values), None unless they lie exactly on one; the
    counts and `n` are a whole number of steps apart, so the value is a whole number of bytes."""
    step = counts[1] - counts[0]
    if not _on_a_line(values) or (n - counts[0]) % step:
        return None
    return values[0] + (values[1] - values[0]) * ((n - counts[0]) // step)


def _highest(values: list[tuple[int, int]]) -> tuple[int, int]:
    return max(values, key=lambda v: v[0])  # the first of the highest: the tracker keeps the first moment of a peak


def _name(key) -> str:
    if key is None:
        return "the step before the blocks"
    phase, end, distance = key
    side = "after" if end == "first" else "before"
    block = f"the {end} block" if distance == 0 else f"the block {distance} {side} the {end}"
    return f"the {phase} of {block}"
