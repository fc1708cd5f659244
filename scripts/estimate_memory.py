"""Per-rank memory of a training config on a mesh, without GPUs and without allocating the model.

    python scripts/estimate_memory.py --job.config_file train_configs/llama3_70b.toml [--world_size 64] [overrides]

`--world_size` (this script's option) defaults to NGPU when set, else to the product of the degrees when none is -1,
else to the config's usual cluster (DEFAULT_WORLD): the degrees leave the world size open, the estimate needs one.
`--routing worst` traces a mixture of experts at its routing's bound instead of balanced (its other option): dropless,
or with a capacity factor (moe.capacity_factor) as many slots as the capacity lets through.
Everything else is a trainer option. How the figures are obtained and what they leave out: see
torchtitan_lite/tools/memory.py.

The figures go to stdout; what the estimate is doing as it goes goes to stderr, one line as each piece starts (so
also when the one before it finished), with the time since the start: a big config traces for minutes.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time

from torchtitan_lite.config import ConfigError, JobConfig, help_text, load_config
from torchtitan_lite.quantization import float8
from torchtitan_lite.tools.memory import Estimate, estimate_memory, progress

# torchtitan's usual cluster per flavor; any other flavor: one 8-GPU node.
DEFAULT_WORLD = {"8B": 8, "70B": 64, "405B": 128}


def usage() -> str:
    """--help: this script's own option, then the trainer's, which it takes as they are."""
    clusters = ", ".join(f"{flavor} {n}" for flavor, n in DEFAULT_WORLD.items())
    return "\n".join([
        "usage: python scripts/estimate_memory.py [--world_size N] [--routing balanced|worst] [--job.config_file FILE] "
        "[--section.key VALUE ...]",
        "Per-rank memory of a training config on a mesh, without GPUs (torchtitan_lite/tools/memory.py says how).",
        "  --world_size N  the ranks to estimate for; default: NGPU when set, else the product of the parallelism",
        f"      degrees when none is -1, else the flavor's usual cluster ({clusters}; any other flavor 8)",
        "  --routing R     a mixture of experts' routing: balanced (default), or worst: every rank's tokens sent to",
        "      rank 0's experts, ep x tokens x min(top_k, local experts) slots received (dropless routing's bound;",
        "      with moe.capacity_factor, at most the capacity's slots of each sequence, per expert)",
        "Every other argument is a train.py option (--check aside); train.py's --help:",
        "",
        help_text(),
    ])


def split_options(argv: list[str]) -> tuple[int | None, list[str], str]:
    """(--world_size N or None, the other arguments, --routing's value) from argv."""
    rest, world, routing = [], None, "balanced"
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name not in ("--world_size", "--routing"):
            rest.append(arg)
            continue
        value = value if eq else next(args, "")
        if name == "--routing":
            if value not in ("balanced", "worst"):
                raise ConfigError(f"--routing expects balanced or worst (got {value!r})")
            routing = value
            continue
        if not value.isdecimal() or int(value) < 1:
            raise ConfigError(f"--world_size expects a positive integer (got {value!r})")
        world = int(value)
    return world, rest, routing


def default_world_size(cfg: JobConfig) -> int:
    if os.environ.get("NGPU", "").isdecimal():
        return int(os.environ["NGPU"])
    p = cfg.parallelism
    degrees = (p.pipeline_parallel_degree, p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
               p.context_parallel_degree, p.tensor_parallel_degree)
    if -1 not in degrees:
        return math.prod(degrees)
    return DEFAULT_WORLD.get(cfg.model.flavor, 8)


def table(e: Estimate, cfg: JobConfig) -> str:
    unit, scale = ("GiB", 2**30) if e.peak_bytes >= 2**30 else ("MiB", 2**20)
    mesh = " x ".join(f"{name} {size}" for name, size in e.mesh.items())
    ep = cfg.parallelism.expert_parallel_degree  # not a dim of the mesh: a split of dp_shard x cp x tp (dims.py)
    experts = f", experts over ep {ep}" if ep > 1 else ""
    if ep > 1 and e.routing == "worst":
        factor = cfg.moe.capacity_factor  # the config's; a flavor's is 0 (dropless)
        bound = f"capacity factor {factor:g}'s bound" if factor else "dropless routing's bound"
        experts += f", routed at {bound}: every rank's tokens to rank 0's experts"
    t = cfg.training
    compute = t.mixed_precision_param
    if float8.enabled(cfg):  # what tools/memory.py counts for it: its module docstring
        gathered = float8.all_gathers_float8(cfg, e.mesh["dp_replicate"] * e.mesh["dp_shard"] * e.mesh["cp"] > 1)
        compute += f" + float8 {cfg.float8.recipe_name}{' (float8 all-gather)' if gathered else ''}"
    header = (f"{cfg.model.name} {e.flavor} (vocab {e.vocab_size}), {t.local_batch_size} x {t.seq_len} tokens, "
              f"{compute} compute, AC {cfg.activation_checkpoint.mode}, mesh {mesh} "
              f"({math.prod(e.mesh.values())} ranks{experts}); per rank, {unit}")
    lines = [header, f"  ({e.vocab_note})"]
    if len(e.traced) > 1:
        counts = f"{', '.join(map(str, e.traced[:-1]))} and {e.traced[-1]}"
        lines.append(f"  (traced with {counts} of its blocks: every figure exactly affine in the block count)")
    where = " (host)" if e.host_bytes else ""
    rows = [(f"parameters{where}", e.param_bytes), (f"gradients{where}", e.grad_bytes),
            (f"optimizer state{where}", e.optimizer_bytes), ("activations", e.activation_bytes),
            ("transient buffers", e.transient_bytes), ("peak (device)" if e.host_bytes else "peak", e.peak_bytes)]
    lines += [f"  {name:<24}{value / scale:10.2f}" for name, value in rows]
    if e.mask_bytes:
        kernel = "explicit" if e.mesh.get("cp", 1) > 1 else "FlexAttention block"
        lines.append(f"  (activations hold block_causal's {kernel} mask: {e.mask_bytes / scale:.4f} {unit} a "
                     "micro-batch)")
    return "\n".join(lines)


class Elapsed(logging.Formatter):
    """`estimate_memory [ 12.1 s]: step 1 of 2: optimizer step`, the time counted from this formatter's creation."""

    def __init__(self):
        super().__init__()
        self.start = time.time()

    def format(self, record: logging.LogRecord) -> str:
        return f"estimate_memory [{record.created - self.start:5.1f} s]: {record.getMessage()}"


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:  # before load_config, which would print the trainer's alone
        print(usage())
        return 0
    shown = logging.StreamHandler(sys.stderr)
    shown.setFormatter(Elapsed())
    progress.addHandler(shown)
    progress.setLevel(logging.INFO)
    try:
        world, rest, routing = split_options(argv)
        cfg = load_config(rest)
        estimate = estimate_memory(cfg, world or default_world_size(cfg), routing=routing)
        progress.info("done")
        print(table(estimate, cfg))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        progress.removeHandler(shown)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
