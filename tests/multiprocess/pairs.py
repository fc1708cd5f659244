"""Every pair of options that changes how a step computes is run or refused (issue 23): the factor table, its
constraints, and a small greedy covering-array generator.

A factor is an option, or a layout dimension, with the levels it takes; a pair is two factors' levels. The suite's
shared runs (run_table.SHARED_RUNS) are read back into levels through the trainer's own config loader and mesh
degrees (`levels_of`), so what they cover is computed, not kept by hand, and `generate` adds rows only for the pairs
they miss. Those rows run in the shared runs' torchrun jobs (run_table.PAIR_RUNS) and test_pairs.py compares each
with the single-process run of its precision.

A pair needs no run when it is no configuration (IMPOSSIBLE), when a layout ignores one of its options
(NOT_APPLICABLE: the option changes nothing there, so a run would repeat the pair without it), or when
`train.py --check` refuses it (REFUSED, each tested through --check). The data-parallel factor is the mesh FSDP
shards over, dp_shard x cp (torchtitan_lite/parallel/dims.py): what decides how gradients are reduced.
"""

from __future__ import annotations

import functools
from collections import Counter
from itertools import combinations
from pathlib import Path
from typing import Optional

from launch import COMMON, FLOAT8, train_argv
from torchtitan_lite.config import JobConfig, load_config
from torchtitan_lite.parallel.dims import ParallelDims

GLOBAL_BATCH = 8  # every shared run's (launch.COMMON): the rows' sizes below are cut from it
FACTORS = {  # factor -> levels; the first is the default, what a run that does not set the option computes
    "pp": ("off", "on"),  # pipeline_parallel_degree > 1
    "cp": ("off", "on"),  # context_parallel_degree > 1
    "tp": ("off", "on"),  # tensor_parallel_degree > 1
    "dp": ("none", "fsdp", "hsdp", "ddp"),  # FSDP's mesh: none, (shard), (replicate, shard), (replicate, 1)
    "precision": ("float32", "bfloat16", "float16"),  # training.mixed_precision_param
    "reduce": ("float32", "bfloat16"),  # training.mixed_precision_reduce
    "ac": ("none", "full", "selective_n", "selective_op"),  # activation_checkpoint.mode (+ selective_ac_option)
    "compile": ("off", "on"),  # compile.enable
    "offload": ("off", "on"),  # parallelism.fsdp_cpu_offload
    "accumulation": ("off", "on"),  # global batch > local batch x data-parallel degree
    "defer_reduce": ("off", "on"),  # parallelism.fsdp_defer_grad_reduce
    "hpz": ("off", "on"),  # parallelism.fsdp_reshard_after_forward = N
    "prefetch": ("off", "on"),  # parallelism.fsdp_prefetch > 0
    "async_checkpoint": ("off", "on"),  # checkpoint.async_mode async, with checkpoint.enable
    "validation": ("off", "on"),  # validation.enable
    "skip_nonfinite": ("off", "on"),  # training.skip_nonfinite_steps > 0
    "float8": ("off", "tensorwise", "rowwise"),  # float8.enable_float8_linear, float8.recipe_name
    "float8_all_gather": ("off", "on"),  # float8.enable_fsdp_float8_all_gather (with its scale precompute)
}
LAYOUT = ("pp", "cp", "tp", "dp")
FSDP_OPTIONS = ("reduce", "offload", "defer_reduce", "hpz", "prefetch", "float8_all_gather")
# (levels, the factors that layout ignores, why): a pair of such a factor's non-default level with these levels is
# not applicable, and a run's ignored options count at their default (what the step computes).
NOT_APPLICABLE = (
    ({"dp": "none"}, FSDP_OPTIONS, "no data or context parallelism, so no FSDP: its options and the reduce dtype "
                                   "are ignored (warned at start-up)"),
    ({"pp": "on"}, ("defer_reduce",), "a pipeline schedule reduces once per local batch itself (warned at start-up)"),
    ({"float8": "off"}, ("float8_all_gather",), "no float8 linears, so no float8 weights to gather (warned at "
                                                "start-up)"),
)
# Levels that name no layout, and why.
IMPOSSIBLE = (
    ({"cp": "on", "dp": "none"}, "FSDP shards over dp_shard x cp: context parallelism always brings FSDP"),
    ({"cp": "on", "dp": "ddp"}, "replicas of a cp-sharded model are HSDP: FSDP's mesh is (replicate, dp_shard x cp)"),
)
# Pairs train.py --check refuses: (factor, level), (factor, level) -> (processes, overrides, what the line says).
REFUSED: dict[tuple[tuple[str, str], tuple[str, str]], tuple[int, tuple[str, ...], str]] = {
    # fp16 under PP, once refused (its first stages never scaled the loss), takes the job's one loss scale now
    # (precision.LossScaler) and runs in a generated row. Float8 (quantization/float8.py says why):
    **{(("cp", "on"), ("float8", recipe)): (2, ("--parallelism.context_parallel_degree", "2", *FLOAT8,
                                                "--float8.recipe_name", recipe), "float8 under context parallelism")
       for recipe in ("tensorwise", "rowwise")},
    **{(("precision", "float16"), ("float8", recipe)): (1, ("--training.mixed_precision_param", "float16", *FLOAT8,
                                                            "--float8.recipe_name", recipe), "float8 with training."
                                                            "mixed_precision_param float16")
       for recipe in ("tensorwise", "rowwise")},
    (("float8", "rowwise"), ("float8_all_gather", "on")): (2, (*FLOAT8, "--float8.recipe_name", "rowwise",
                                                               "--float8.enable_fsdp_float8_all_gather"),
                                                           "float8.enable_fsdp_float8_all_gather needs recipe_name "
                                                           "tensorwise"),
    # The float8 all-gather gathers float8 linears' weights: refused where float8 is.
    (("cp", "on"), ("float8_all_gather", "on")): (2, ("--parallelism.context_parallel_degree", "2", *FLOAT8,
                                                      "--float8.enable_fsdp_float8_all_gather"),
                                                  "float8 under context parallelism"),
    (("precision", "float16"), ("float8_all_gather", "on")): (2, ("--training.mixed_precision_param", "float16",
                                                                  *FLOAT8, "--float8.enable_fsdp_float8_all_gather"),
                                                              "float8 with training.mixed_precision_param float16"),
}
MAX_WORLD = 4  # processes of a row; 8 only for the pairs that need them (HSDP's 4 ranks beside PP or TP)
FLOAT8_MICRO_BATCH = 2  # sequences: tests/assets/tiny.toml's local batch, the single-process references' micro-batch


def layout(row: dict[str, str]) -> tuple[int, int, int, int, int, int]:
    """(pp, cp, tp, replicate, shard, processes) of a row's layout levels (unset ones at their default)."""
    pp, cp, tp = (2 if row.get(f) == "on" else 1 for f in ("pp", "cp", "tp"))
    dp = row.get("dp", "none")
    replicate = 2 if dp in ("hsdp", "ddp") else 1
    shard = 2 if dp in ("fsdp", "hsdp") and cp == 1 else 1  # under CP, FSDP shards over cp already
    return pp, cp, tp, replicate, shard, pp * cp * tp * replicate * shard


def local_batch(row: dict[str, str]) -> int:
    """Sequences per micro-batch: the global batch over the data-parallel ranks, halved to accumulate two."""
    _, _, _, replicate, shard, _ = layout(row)
    return GLOBAL_BATCH // (replicate * shard) // (2 if row.get("accumulation") == "on" else 1)


def matches(row: dict[str, str], levels: dict[str, str]) -> bool:
    return all(row.get(f) == level for f, level in levels.items())


def allowed(row: dict[str, str], max_world: int = 8) -> bool:
    """Whether a (partial) row breaks no constraint among its set factors; the last two are the tests' budget."""
    if any(matches(row, levels) for levels, _ in IMPOSSIBLE):
        return False
    if any(matches(row, levels) and any(row.get(f, FACTORS[f][0]) != FACTORS[f][0] for f in ignored)
           for levels, ignored, _ in NOT_APPLICABLE):
        return False
    if any(matches(row, dict(pair)) for pair in REFUSED):
        return False
    pp, _, tp, _, _, world = layout(row)
    if world > (max_world if row.get("dp") == "hsdp" and pp * tp > 1 else MAX_WORLD):
        return False
    if world > MAX_WORLD and any(row.get(f, levels[0]) != levels[0] for f, levels in FACTORS.items() if f not in LAYOUT):
        return False  # 8 ranks start slowly on a few cores: such a row runs its layout and nothing else
    if world > 2 and row.get("compile") == "on" and row.get("float8", "off") != "off":
        return False  # compiling emulated float8 costs a rank most: such a row runs on 2 (docs/testing.md)
    if row.get("float8", "off") != "off" and all(f in row for f in ("pp", "dp", "accumulation")) and \
            local_batch(row) != FLOAT8_MICRO_BATCH * pp:
        return False  # a float8 row's micro-batches are its reference's: a tensorwise scale spans a micro-batch
    # A pipeline cuts each local batch into pp micro-batches.
    return local_batch(row) >= 1 and local_batch(row) % pp == 0


def complete(row: dict[str, str], max_world: int = 8) -> Optional[dict[str, str]]:
    """`row` with its unset factors filled in, defaults first, so that it breaks no constraint; None if none can."""
    done = _complete(frozenset(row.items()), max_world)
    return None if done is None else {**row, **{f: done[f] for f in FACTORS if f not in row}}


@functools.lru_cache(maxsize=None)  # the generator asks for the same partial rows again and again
def _complete(items: frozenset, max_world: int) -> Optional[dict[str, str]]:
    row = dict(items)
    if not allowed(row, max_world):
        return None
    unset = [f for f in FACTORS if f not in row]
    if not unset:
        return row
    return next((done for level in FACTORS[unset[0]] if (done := _complete(items | {(unset[0], level)}, max_world))),
                None)


ORDER = list(FACTORS)


def pair(a: tuple[str, str], b: tuple[str, str]) -> tuple[tuple[str, str], tuple[str, str]]:
    """Two (factor, level)s in the table's order, as every set of pairs here holds them."""
    return (a, b) if ORDER.index(a[0]) < ORDER.index(b[0]) else (b, a)


def pairs_of(row: dict[str, str]) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    return {(a, b) for a, b in combinations([(f, row[f]) for f in FACTORS], 2)}


def applicable_pairs() -> set[tuple[tuple[str, str], tuple[str, str]]]:
    """Every pair some run can hold, less the refused ones: what must be covered."""
    out = set()
    for (f, g) in combinations(FACTORS, 2):
        for a in FACTORS[f]:
            for b in FACTORS[g]:
                pair = ((f, a), (g, b))
                if pair not in REFUSED and complete({f: a, g: b}) is not None:
                    out.add(pair)
    return out


def excluded_pairs() -> dict[tuple[tuple[str, str], tuple[str, str]], str]:
    """Every pair that needs no run, with why: the reasoning of the constraints above, listed."""
    out = {}
    for (f, g) in combinations(FACTORS, 2):
        for a in FACTORS[f]:
            for b in FACTORS[g]:
                pair, row = ((f, a), (g, b)), {f: a, g: b}
                why = [w for levels, w in IMPOSSIBLE if matches(row, levels)]
                why += [w for levels, ignored, w in NOT_APPLICABLE
                        if matches(row, levels) and any(row.get(x, FACTORS[x][0]) != FACTORS[x][0] for x in ignored)]
                why += [f"refused by --check: {REFUSED[pair][2]}"] if pair in REFUSED else []
                if why or complete(row) is None:
                    out[pair] = "; ".join(why) or "beyond the tests' processes or global batch"
    return out


@functools.lru_cache(maxsize=None)  # the generator, the kinds of run_table.py and the tests ask for the same runs
def parsed(nproc: int, overrides: tuple[str, ...]) -> tuple[JobConfig, ParallelDims]:
    """A run's config and mesh degrees, read by the trainer's own loader as the run itself reads them (shared by
    every caller: never changed)."""
    cfg = load_config(list(train_argv(Path("unused"), *COMMON, *overrides)))
    return cfg, ParallelDims.from_config(cfg.parallelism, nproc)


def levels_of(nproc: int, overrides: tuple[str, ...]) -> dict[str, str]:
    """A run's levels, read through the trainer's config loader and mesh degrees as the run itself reads them; an
    option its layout ignores counts at its default."""
    cfg, dims = parsed(nproc, tuple(overrides))
    t, p = cfg.training, cfg.parallelism
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    sharded, ac = dims.dp_shard * dims.cp, cfg.activation_checkpoint
    row = {
        "pp": on(dims.pp > 1), "cp": on(dims.cp > 1), "tp": on(dims.tp > 1),
        "dp": ("none", "fsdp", "ddp", "hsdp")[(dims.dp_replicate > 1) * 2 + (sharded > 1)],
        "precision": t.mixed_precision_param, "reduce": t.mixed_precision_reduce,
        "ac": ac.mode if ac.mode != "selective" else f"selective_{'op' if ac.selective_ac_option == 'op' else 'n'}",
        "compile": on(cfg.compile.enable), "offload": on(p.fsdp_cpu_offload),
        "accumulation": on(dims.global_batch(t.local_batch_size, t.global_batch_size) > t.local_batch_size * dims.dp),
        "defer_reduce": on(p.fsdp_defer_grad_reduce), "hpz": on(p.fsdp_reshard_after_forward.isdecimal()),
        "prefetch": on(p.fsdp_prefetch > 0), "async_checkpoint": on(cfg.checkpoint.enable and
                                                                      cfg.checkpoint.async_mode == "async"),
        "validation": on(cfg.validation.enable), "skip_nonfinite": on(t.skip_nonfinite_steps > 0),
        "float8": cfg.float8.recipe_name if cfg.float8.enable_float8_linear else "off",
        "float8_all_gather": on(cfg.float8.enable_fsdp_float8_all_gather),
    }
    for levels, ignored, _ in NOT_APPLICABLE:
        if matches(row, levels):
            row.update({f: FACTORS[f][0] for f in ignored})
    return row


ARGS = {  # (factor, level) -> overrides, for the levels whose overrides do not depend on the layout
    ("precision", "bfloat16"): ("--training.mixed_precision_param", "bfloat16"),
    ("precision", "float16"): ("--training.mixed_precision_param", "float16"),
    ("reduce", "bfloat16"): ("--training.mixed_precision_reduce", "bfloat16"),
    ("ac", "full"): ("--activation_checkpoint.mode", "full"),
    ("ac", "selective_n"): ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                            "2"),
    ("ac", "selective_op"): ("--activation_checkpoint.mode", "selective",
                             "--activation_checkpoint.selective_ac_option", "op"),
    ("compile", "on"): ("--compile.enable", "--compile.backend", "aot_eager"),  # inductor is slow on a CPU
    ("offload", "on"): ("--parallelism.fsdp_cpu_offload", "--no-parallelism.fsdp_offload_pin_memory"),  # no GPU
    ("defer_reduce", "on"): ("--parallelism.fsdp_defer_grad_reduce",),
    ("prefetch", "on"): ("--parallelism.fsdp_prefetch", "2"),
    ("async_checkpoint", "on"): ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode",
                                 "async"),
    ("validation", "on"): ("--validation.enable", "--validation.freq", "2", "--validation.steps", "1"),
    ("skip_nonfinite", "on"): ("--training.skip_nonfinite_steps", "1"),
    ("float8", "tensorwise"): FLOAT8,
    ("float8", "rowwise"): (*FLOAT8, "--float8.recipe_name", "rowwise"),
    # The scales' precompute too: under TP the float8 all-gather needs it (--check refuses it alone there).
    ("float8_all_gather", "on"): ("--float8.enable_fsdp_float8_all_gather",
                                  "--float8.precompute_float8_dynamic_scale_for_fsdp"),
}
# Steps a generated row trains, enough to show the update and the optimizer state at work (step 2 runs on step 1's
# update, warmup's lr already > 0, and AdamW's moments), and on what: half precision is slow on a CPU (one process
# autocasts fp16 at seconds a step), so its rows train on sequences of 16.
STEPS = {"float32": 2, "bfloat16": 2, "float16": 2}
SIZE = {"float32": (), "bfloat16": ("--training.seq_len", "16"), "float16": ("--training.seq_len", "16")}
# The single-process runs each half-precision row is compared with ("single", a shared run, is float32's; the
# float8 ones, run_table.FLOAT8_RUNS, are float32 float8's).
REFERENCES = {f"single_{p}": (1, ("--training.mixed_precision_param", p, "--training.steps", str(STEPS[p]), *SIZE[p]))
              for p in ("bfloat16", "float16")}
REFERENCES |= {f"single_bfloat16_float8{'_rowwise' * (recipe == 'rowwise')}": (
    1, (*REFERENCES["single_bfloat16"][1], *ARGS[("float8", recipe)])) for recipe in ("tensorwise", "rowwise")}


def reference(levels: dict[str, str]) -> str:
    """The shared run a row of these levels is compared with: the single process of its precision and float8."""
    precision, float8 = levels["precision"], levels["float8"]
    if float8 == "off":
        return "single" if precision == "float32" else f"single_{precision}"
    rowwise = "_rowwise" * (float8 == "rowwise")
    return f"float8{rowwise}_single" if precision == "float32" else f"single_{precision}_float8{rowwise}"


def args_of(row: dict[str, str]) -> tuple[int, tuple[str, ...]]:
    """A row's processes and train.py overrides."""
    pp, cp, tp, replicate, shard, world = layout(row)
    out = ["--training.local_batch_size", str(local_batch(row)), "--training.steps", str(STEPS[row["precision"]]),
           *SIZE[row["precision"]]]
    for degree, value in (("pipeline_parallel", pp), ("context_parallel", cp), ("tensor_parallel", tp),
                          ("data_parallel_replicate", replicate), ("data_parallel_shard", shard)):
        if value > 1 or degree == "data_parallel_shard":
            out += [f"--parallelism.{degree}_degree", str(value)]
    if row["hpz"] == "on":  # a group of half the shards; on 2 shards or fewer the whole shard dim (FSDP's True)
        sharded = shard * cp
        out += ["--parallelism.fsdp_reshard_after_forward", str(sharded // 2 if sharded >= 4 else sharded)]
    for f, level in row.items():
        out += ARGS.get((f, level), ())
    return world, tuple(out)


def fill(row: dict[str, str], order: list[str], uncovered: set) -> dict[str, str]:
    """`row` completed factor by factor in `order`, each with the level that covers the most `uncovered` pairs with
    the factors already set (the default on a tie), as long as the row can still be completed."""
    for h in order:
        if h not in row:
            gain = lambda lv: sum(pair((h, lv), (x, row[x])) in uncovered for x in row)  # noqa: E731
            row[h] = max((lv for lv in FACTORS[h] if complete({**row, h: lv})), key=gain)  # max keeps the first
    return row


def generate(runs: list[tuple[int, tuple[str, ...]]]) -> dict[str, tuple[int, tuple[str, ...]]]:
    """Rows that cover every applicable pair `runs` ((processes, overrides) each) miss: greedy (AETG-like) and
    deterministic, so every session makes the same rows; then pruned of costly levels they need not hold."""
    uncovered = applicable_pairs()
    for nproc, overrides in runs:
        uncovered -= pairs_of(levels_of(nproc, overrides))
    wide = {p for p in uncovered if complete(dict(p), MAX_WORLD) is None}  # a row of 8 processes only for these
    needed, rows = set(uncovered), []
    while uncovered:
        count = Counter(side for p in sorted(uncovered) for side in p)  # uncovered pairs each (factor, level) is in
        order = sorted(FACTORS, key=lambda f: -sum(n for side, n in count.items() if side[0] == f))  # stable
        # A candidate row from each of the 4 (factor, level)s in most uncovered pairs; the one covering most wins
        # (fewest processes on a tie, then the first).
        candidates = [fill({f: level}, order, uncovered) for f, level in sorted(count, key=lambda s: -count[s])[:4]]
        candidates = [r for r in candidates if layout(r)[-1] <= MAX_WORLD or pairs_of(r) & wide & uncovered]
        row = max(candidates, key=lambda r: (len(pairs_of(r) & uncovered), -layout(r)[-1]))
        uncovered -= pairs_of(row)
        rows.append(row)
    rows = prune(rows, needed)
    return {f"pairs{i + 1}_{row['precision']}_{args_of(row)[0]}p": args_of(row) for i, row in enumerate(rows)}


# Levels that cost a row most beyond its steps: compiling (twice where it validates: eval is another graph), float8's
# emulated matmuls, validation, saving in the background.
COSTLY = ("compile", "float8", "validation", "async_checkpoint")


def prune(rows: list[dict[str, str]], needed: set) -> list[dict[str, str]]:
    """`rows` with each costly level set back to its default wherever the other rows hold every `needed` pair it
    held: the greedy fills a row's free factors with whatever covers most, often pairs another row covers again."""
    rows = [dict(row) for row in rows]
    for i, row in enumerate(rows):
        for f in COSTLY:
            if row[f] == FACTORS[f][0]:
                continue
            lighter = complete({**row, f: FACTORS[f][0]})
            others = set().union(*(pairs_of(r) for j, r in enumerate(rows) if j != i))
            if lighter == {**row, f: FACTORS[f][0]} and needed & pairs_of(row) <= others | pairs_of(lighter):
                rows[i] = row = lighter
    return rows
