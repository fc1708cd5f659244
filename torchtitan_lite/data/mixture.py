"""Mixtures: several sources in one global order of windows, each holding an exact share of every global batch.

The loader's order stays a pure function of the global position p (loader.py): step s = p // G reads slots
[0, G) of its batch, G the global batch. A phase's weights become integer quotas per batch (largest remainder,
summing to G), and the batch's slots are dealt to the sources (`spread`) so that every data-parallel rank's slice
holds each source within one window of its share. Where a window lands among the slices depends on the dp degree, what
the batch holds never does: a source's own position is the
windows it consumed before step s (quota x steps, summed over the phases: O(#phases)) plus the slot's rank among its
slots in the batch, and the source reads that position of its own seeded order. So the state is still the position,
a resume on any layout and across a phase boundary continues the exact sequence, each source's positions are
consumed contiguously (over E epochs every window appears exactly E times), and a future phase may be edited freely.
What shaped the past (G, the quotas of the steps done, each source's windows, the seed) is the checkpoint's `digest`:
a resume that would change it is refused with one line, since it would silently replay or skip windows.

Each source's order is keyed by (seed, name), so reordering the list changes nothing; a mixture of one source keeps
the plain loader's key and is today's run bit for bit.
"""

from __future__ import annotations

import logging
from fractions import Fraction
from typing import Any, Callable

import torch

from torchtitan_lite.config import ConfigError, JobConfig, Source
from torchtitan_lite.data.digest import part_digest
from torchtitan_lite.data.loader import FILES, build_source, build_sources

logger = logging.getLogger("torchtitan_lite")


def quotas(weights: dict[str, float], global_batch: int, where: str) -> dict[str, int]:
    """Windows per global batch for each source: largest remainder of G x weight / sum, ties broken by name."""
    for name, w in weights.items():
        if not (w >= 0 and w != float("inf")):
            raise ConfigError(f"{where}: the weight of {name!r} is {w}: weights must be >= 0 and finite")
    total = sum(Fraction(w) for w in weights.values())
    if total == 0:
        raise ConfigError(f"{where}: every weight is 0: give at least one source a positive weight")
    exact = {n: Fraction(w) * global_batch / total for n, w in weights.items()}
    out = {n: int(x) for n, x in exact.items()}  # floors
    by_remainder = sorted(exact, key=lambda n: (-(exact[n] - out[n]), n))
    for n in by_remainder[: global_batch - sum(out.values())]:
        out[n] += 1
    for n, w in weights.items():
        if w > 0 and out[n] == 0:
            raise ConfigError(f"{where}: weight {w:g} of {n!r} is {float(exact[n]):.3g} of the {global_batch} "
                              f"windows of a global batch, which rounds to 0: raise it, set it to 0, or raise "
                              f"training.global_batch_size")
    return out


def spread(counts: list[int], slices: int = 1) -> list[int]:
    """The source of each of the batch's slots, for a batch cut into `slices` equal data-parallel slices: each slice
    holds each source's share to within one window (q // slices of it, and one of its q % slices extra windows, dealt
    round-robin over the slices: fewer than `slices` of them, so never two in one slice), and inside a slice every
    prefix does too (`_prefix_spread`). Which slice a window lands in never changes what the batch holds."""
    extras = [i for i, q in enumerate(counts) for _ in range(q % slices)]
    shares = [[q // slices for q in counts] for _ in range(slices)]
    for j, i in enumerate(extras):
        shares[j % slices][i] += 1
    return [i for share in shares for i in _prefix_spread(share)]


def _prefix_spread(counts: list[int]) -> list[int]:
    """Slot j goes to the source furthest behind (j+1) x its share (ties to the bigger count, then the first), so
    every prefix holds each source within one window of proportional."""
    g, taken, out = sum(counts), [0] * len(counts), []
    for j in range(g):
        i = max(range(len(counts)), key=lambda i: ((j + 1) * counts[i] - taken[i] * g, counts[i], -i))
        taken[i] += 1
        out.append(i)
    return out


class MixtureSource:
    """Sources (name -> source of windows) in one global order; `phases` are (start_step, {name: weight}) in step
    order, the first at step 0."""

    def __init__(self, parts: dict[str, Any], phases: list[tuple[int, dict[str, float]]], global_batch: int,
                 slices: int = 1, seed: int | None = None):
        """`slices`: the data-parallel degree, whose ranks' slices spread() balances. `seed`: the training.seed
        that keys the parts' orders (build_data), for the digest."""
        self.names = sorted(parts)  # by name, not list order: reordering the config changes nothing
        self.parts, self.global_batch, self.seed = [parts[n] for n in self.names], global_batch, seed
        self.starts = [start for start, _ in phases]
        self.quotas = []  # per phase, per source (name order)
        for start, weights in phases:
            where = "mixture weights" if start == 0 else f"mixture phase at step {start}"
            q = quotas({n: weights.get(n, 0.0) for n in self.names}, global_batch, where)
            self.quotas.append([q[n] for n in self.names])
        # Per phase: each slot's (source, rank among that source's slots in the batch).
        self.slots = []
        for q in self.quotas:
            seen = [0] * len(q)
            slots = []
            for i in spread(q, slices):
                slots.append((i, seen[i]))
                seen[i] += 1
            self.slots.append(slots)
        self.streaming = [getattr(p, "streaming", False) for p in self.parts]

    def phase_at(self, step: int) -> int:
        return max(k for k, start in enumerate(self.starts) if start <= step)

    def consumed(self, step: int) -> list[int]:
        """Windows each source gave to the steps before `step`."""
        ends = [*self.starts[1:], None]
        out = [0] * len(self.names)
        for start, end, q in zip(self.starts, ends, self.quotas):
            steps = max(0, min(step, end if end is not None else step) - start)
            out = [o + steps * n for o, n in zip(out, q)]
        return out

    def positions(self, index: list[int]) -> list[tuple[int, int]]:
        """(source, position in the source's own order) of each global position."""
        out, cache = [], {}
        for p in index:
            step, slot = divmod(p, self.global_batch)
            if step not in cache:
                cache[step] = (self.slots[self.phase_at(step)], self.consumed(step))
            slots, consumed = cache[step]
            i, rank = slots[slot]
            out.append((i, consumed[i] + rank))
        return out

    def windows(self, index: torch.Tensor, take: Callable[[int, int], torch.Tensor] | None = None,
                where: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """The windows at global positions `index` (`where`: their positions(), if the caller has them already);
        `take(source, n)` gives this rank's next n windows of a streaming source (a Hugging Face stream is read in
        order per rank, not at positions)."""
        where = where if where is not None else self.positions(index.view(-1).tolist())
        rows: list[torch.Tensor | None] = [None] * len(where)
        for i, part in enumerate(self.parts):
            mine = [r for r, (src, _) in enumerate(where) if src == i]
            if not mine:
                continue
            if self.streaming[i]:
                got = take(i, len(mine))
            else:
                got = part.windows(torch.tensor([where[r][1] for r in mine]))
            for r, w in zip(mine, got):
                rows[r] = w
        return torch.stack(rows)

    # ---- What the run will take, and what shaped the past

    def plan(self, steps: int) -> list[dict[str, Any]]:
        """Per source: its windows per epoch (None: endless or streamed), weight and quota at step 0, and the epochs
        `steps` steps take through it."""
        consumed = self.consumed(steps)
        out = []
        for i, (name, part) in enumerate(zip(self.names, self.parts)):
            n = getattr(part, "n", None)
            out.append({"name": name, "windows": n, "quota": self.quotas[0][i], "windows_read": consumed[i],
                        "epochs": consumed[i] / n if n else None})
        return out

    def digest(self, step: int) -> dict[str, Any]:
        """What shaped the windows of the steps before `step`: G, the quotas of those steps (equal neighbours merged,
        so a phase split in two with the same weights is the same past), each source that gave any window, and the
        seed when it keys one of theirs."""
        segments: list[list[Any]] = []
        for start, q in zip(self.starts, self.quotas):
            if start >= step:
                break
            named = {n: c for n, c in zip(self.names, q) if c}
            if not segments or segments[-1][1] != named:
                segments.append([start, named])
        used = {n for _, named in segments for n in named}
        seeded = self.seed is not None and any(hasattr(p, "seed") for n, p in zip(self.names, self.parts) if n in used)
        return {"global_batch": self.global_batch, "quotas": segments, **({"seed": self.seed} if seeded else {}),
                "sources": {n: part_digest(p) for n, p in zip(self.names, self.parts) if n in used}}


# ---- Building a mixture from the config


def build_data(cfg: JobConfig, tokenizer, global_batch: int, dp: int = 1) -> tuple[Any, dict[str, Any]]:
    """The training source and the validation sources by name ({"": source} for one dataset, {} with validation
    off): [mixture]'s sources when training.dataset is "mixture", else training.dataset as always."""
    t, v, m = cfg.training, cfg.validation, cfg.mixture
    if t.dataset != "mixture":
        if m.sources or m.phases or m.weights:
            raise ConfigError(f"[mixture] is set but training.dataset is {t.dataset!r}: set training.dataset = "
                              f'"mixture" to train on the mixture, or remove [mixture]')
        source, val = build_sources(t, v, tokenizer)
        return source, {} if val is None else {"": val}
    if not m.sources:
        raise ConfigError('training.dataset is "mixture" but [mixture] has no sources: add [[mixture.sources]] '
                          "tables (name, dataset, weight; docs/data.md)")
    if t.dataset_path:
        raise ConfigError('training.dataset_path is set but training.dataset is "mixture": set each source\'s '
                          "dataset_path in its [[mixture.sources]] table instead")
    if v.enable and v.dataset:
        raise ConfigError("validation.dataset is set but training.dataset is \"mixture\": each source validates on "
                          "its held-out part or its validation_path; clear validation.dataset")
    phases = mixture_phases(cfg)
    lone = len(m.sources) == 1  # today's key: a one-source mixture is the plain run, bit for bit
    parts, vals = {}, {}
    for s in m.sources:
        seed = t.seed if lone else f"{t.seed}/{s.name}"
        parts[s.name], val = _source(s, t.seq_len, tokenizer, seed, v.enable)
        if val is not None:
            vals[s.name] = val
    mixture = MixtureSource(parts, phases, global_batch, dp, t.seed)
    check_caps(mixture, m.sources, t.steps)
    log_plan(mixture, m.sources, t.steps, global_batch)
    return mixture, vals


def mixture_phases(cfg: JobConfig) -> list[tuple[int, dict[str, float]]]:
    """(start_step, weights by name) of every phase, the first the sources' own weights (or --mixture.weights')."""
    m, names = cfg.mixture, [s.name for s in cfg.mixture.sources]
    for s in m.sources:
        if not s.name:
            raise ConfigError(f"a [[mixture.sources]] table (dataset {s.dataset!r}) has no name: give each source a "
                              "unique name")
        if names.count(s.name) > 1:
            raise ConfigError(f"mixture source name {s.name!r} is used {names.count(s.name)} times: names must be "
                              "unique (they key each source's order, metrics and state)")
    weights = {s.name: s.weight for s in m.sources}
    for item in filter(None, (w.strip() for w in m.weights.split(","))):
        name, eq, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = None
        if not eq or weight is None:
            raise ConfigError(f"mixture.weights: {item!r} is not NAME=WEIGHT (write e.g. web=0.7,code=0.3)")
        weights[_known(name.strip(), names, "mixture.weights")] = weight
    phases, last = [(0, weights)], 0
    for p in m.phases:
        if p.start_step <= last:
            raise ConfigError(f"mixture phases must start in increasing steps after 0: the phase at step {p.start_step}"
                              f" comes after the one at step {last}; list them in step order")
        if p.start_step >= cfg.training.steps:
            raise ConfigError(f"the mixture phase at step {p.start_step} starts after the last step (training.steps = "
                              f"{cfg.training.steps}): it would never train; remove it or raise training.steps")
        phases.append((p.start_step, {_known(n, names, f"mixture phase at step {p.start_step}"): w
                                      for n, w in p.weights.items()}))
        last = p.start_step
    return phases


def _known(name: str, names: list[str], where: str) -> str:
    if name not in names:
        raise ConfigError(f"{where}: no source is named {name!r} (the sources are {', '.join(names)})")
    return name


def _source(s: Source, seq_len: int, tokenizer, seed, validate: bool) -> tuple[Any, Any]:
    """A source's training windows and, with validation on, its validation windows."""
    label = f"mixture.sources[{s.name}]"
    source = build_source(s.dataset, s.dataset_path, seq_len, tokenizer, seed, text_field=s.text_field, label=label)
    if not validate:
        return source, None
    if s.validation_path or s.dataset not in FILES:  # its own files, or the split the dataset derives itself
        path = s.validation_path or s.dataset_path
        return source, build_source(s.dataset, path, seq_len, tokenizer, seed, split="validation",
                                    text_field=s.text_field, label=label)
    return source.hold_out()


def check_caps(mixture: MixtureSource, sources: list[Source], steps: int) -> None:
    """A source the run would read more often than its max_epochs allows is refused now, not at the step it happens."""
    caps = {s.name: s.max_epochs for s in sources}
    for row in mixture.plan(steps):
        cap = caps[row["name"]]
        if cap and row["epochs"] is not None and row["epochs"] > cap:
            raise ConfigError(f"mixture source {row['name']!r}: training.steps = {steps} takes {row['epochs']:.3g} "
                              f"epochs of its {row['windows']} windows, over its max_epochs = {cap:g}: lower its "
                              f"weight, add data, or train fewer steps")


def log_plan(mixture: MixtureSource, sources: list[Source], steps: int, global_batch: int) -> None:
    weights = {s.name: s.weight for s in sources}
    lines = [f"mixture plan for {steps} steps of {global_batch} windows (phases start at steps "
             f"{', '.join(map(str, mixture.starts))}):",
             f"  {'source':<16} {'windows':>10} {'weight':>8} {'quota':>6} {'epochs':>8}"]
    for row in mixture.plan(steps):
        windows = "endless" if row["windows"] is None else row["windows"]
        epochs = "-" if row["epochs"] is None else f"{row['epochs']:.3f}"
        lines.append(f"  {row['name']:<16} {windows:>10} {weights[row['name']]:>8g} {row['quota']:>6} {epochs:>8}")
    logger.info("\n".join(lines))
