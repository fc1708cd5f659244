"""The layout-invariant init (torchtitan_lite/models/init.py) against torch's `normal_` on the same shapes, in one process.

    python benchmarks/init_speed.py [--rounds 7] [--threads N] [--other PATH]

Cases, each timed whole, rounds alternating between the sides so that load on a shared machine hits all alike:
- debugmodel: `Transformer.init_weights` of the debug model (its tokenizer's vocabulary), against the same
  `init_weights` with every `trunc_normal_` call replaced by `param.normal_(0, std)`: the same tensors, norms and
  rope table, so the ratio is the cost of layout invariance alone.
- 8B shards: one FSDP 1/8 row shard (rank 3) of a 4096 x 4096 and of a 4096 x 14336 matrix (an 8B block's attention
  and FFN weights) filled by `fill_block_`, against `normal_` on tensors of the shard's shape.
Each case also times this checkout's tensor ops, the path of accelerators and of hosts without a C compiler, beside
its host kernel (init_fill.c). `--other PATH` also times the init.py of another checkout (e.g. `git worktree add
/tmp/old HEAD~1`), loaded beside this one. Every side's values are checked bit-identical to this one's. Times are
medians over the rounds, with torch's thread count (the trainer's: cores per local process) unless --threads says
otherwise. On one thread they are the thread's CPU
time, which a machine shared with other jobs measures reliably (time spent waiting for a core is not the init's, and
both sides run on that one thread); with more threads, wall time.

Prints one line per case and side, and last `init/normal_ time: R` (the debug model's ratio of medians).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import time
from unittest import mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torchtitan_lite.models.init as this_init
import torchtitan_lite.models.init_cpu as init_cpu
from torchtitan_lite.config import load_config
from torchtitan_lite.data.tokenizer import build_tokenizer
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer

SHARDS = {"attention 4096x4096": (4096, 4096), "ffn 4096x14336": (4096, 14336)}
WORLD, RANK = 8, 3


def load_init(path: str):
    """The init.py of another checkout, as a module of its own (it imports only torch and the standard library);
    models/init.py, or init.py in a checkout from before the package had folders."""
    file = next(f for f in (os.path.join(path, "torchtitan_lite", *p) for p in (("models", "init.py"), ("init.py",)))
                if os.path.exists(f))
    spec = importlib.util.spec_from_file_location("other_init", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def debug_model() -> Transformer:
    cfg = load_config(["--job.config_file", os.path.join(ROOT, "train_configs/debug_model.toml")])
    vocab = build_tokenizer(os.path.join(ROOT, cfg.model.tokenizer_path)).n_words
    with torch.device("meta"):
        model = Transformer(FLAVORS["debugmodel"].with_(vocab_size=vocab, max_seq_len=cfg.training.seq_len))
    return model.to_empty(device="cpu")


def model_init(model: Transformer, trunc_normal_) -> dict[str, torch.Tensor]:
    with mock.patch("torchtitan_lite.models.common.decoder.trunc_normal_", trunc_normal_):
        model.init_weights(seed=0)
    return {n: p.detach() for n, p in model.named_parameters()}


def normal_baseline(param, std, cutoff, key):
    param.normal_(0, std)


def shard_init(module, blocks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for name, block in blocks.items():
        rows = block.shape[0]
        module.fill_block_(block, SHARDS[name], (RANK * rows, 0), 0.02, math.inf, f"0/{name}")
    return blocks


def shard_normal(blocks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for block in blocks.values():
        block.normal_(0, 0.02)
    return blocks


def tensor_ops(fn):
    with mock.patch.object(init_cpu, "kernel", lambda: None):
        return fn()


def timed(fn, *args) -> tuple[float, object]:
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    out = fn(*args)
    return clock() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--other", help="another checkout whose init.py to time beside this one")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sides = {"this": this_init}
    if args.other:
        sides["other"] = load_init(args.other)
    model = debug_model()
    blocks = {n: torch.empty(r // WORLD, c) for n, (r, c) in SHARDS.items()}
    n_model = sum(p.numel() for p in model.parameters())
    n_shards = sum(b.numel() for b in blocks.values())
    clock = "thread CPU time" if torch.get_num_threads() == 1 else "wall time"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads ({clock}); "
          f"debugmodel {n_model / 1e6:.2f}M parameters, 8B shards {n_shards / 1e6:.2f}M elements (1/{WORLD}, "
          f"rank {RANK})")

    cases = {"debugmodel": {"normal_": lambda: model_init(model, normal_baseline)},
             "8B shards": {"normal_": lambda: shard_normal(blocks)}}
    for side, module in sides.items():
        cases["debugmodel"][side] = lambda m=module: model_init(model, m.trunc_normal_)
        cases["8B shards"][side] = lambda m=module: shard_init(m, blocks)
    sides["tensor ops"] = this_init
    for fns in cases.values():
        fns["tensor ops"] = lambda fn=fns["this"]: tensor_ops(fn)
    times = {(case, side): [] for case, fns in cases.items() for side in fns}
    values = {}
    for _ in range(args.rounds):
        for case, fns in cases.items():
            for side, fn in fns.items():
                seconds, out = timed(fn)
                times[case, side].append(seconds)
                if side != "normal_":  # copied untimed: the sides fill the same tensors
                    values[case, side] = {n: t.clone() for n, t in out.items()}

    ratios = {}
    for case in cases:
        base = statistics.median(times[case, "normal_"])
        print(f"{case}: normal_ {base * 1e3:.1f} ms")
        for side in sides:
            t = statistics.median(times[case, side])
            ratios[case, side] = t / base
            print(f"{case}: {side} init {t * 1e3:.1f} ms, {t / base:.2f}x normal_")
        for side in sides:
            if side != "this":
                same = all(torch.equal(a, values[case, side][n]) for n, a in values[case, "this"].items())
                print(f"{case}: this and {side} give bit-identical values: {same}")
                if not same:
                    raise SystemExit(f"{case}: this and {side} give different values")
    print(f"init/normal_ time: {ratios['debugmodel', 'this']:.2f}")


if __name__ == "__main__":
    main()
