"""What the trainer adds to a training step: train.py's step time against a bare PyTorch loop, one process, CPU.

    python benchmarks/step_overhead.py [--rounds 3] [--steps 20] [--warmup 3] [--seq_len 256] [--batch 4]

Both sides train the same model (`Transformer(ModelArgs)` of --flavor, `init_weights(seed)`) on the same batches
(build_source + DataLoader) with the same AdamW (foreach), gradient clipping and learning rate, in this process and
with the same thread count (the trainer sets it in init_distributed, and it stays set). A round is one whole
`train.run(argv)` (world size 1, no torchrun, no checkpoint, no validation, log_freq 1) with a fresh bare loop run
inside it, one bare step per trainer step: they alternate step by step, so contention on a shared machine, which
comes and goes within seconds, hits both alike (rounds of K steps each way gave ratios from 0.2 to 2.4 here).

- Trainer: each logged step's tokens/s in metrics.jsonl is measured between consecutive log points, so a step's time
  (global tokens / tps) covers all the trainer does per step, the previous step's logging included, minus the bare
  step run inside it. Start-up and the first --warmup steps are left out.
- Bare: the plainest correct loop (forward, F.cross_entropy, backward, torch.nn.utils.clip_grad_norm_, AdamW,
  zero_grad, loss.item()), each step timed alone. It also runs with automatic GC off, as the trainer sets it.
The two loss curves must agree, which checks that both do the same work: to the last bits, not bitwise, as the
trainer clips by a grad norm summed in float64 and torch's clip_grad_norm_ sums in float32.

Prints each round's median step time of each side, the medians over all rounds' steps, and last
`trainer/bare step time: R` (the ratio of medians; 1.000 = no overhead).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import tempfile
import time
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import train
from torchtitan_lite.config import load_config
from torchtitan_lite.data.loader import DataLoader, build_source
from torchtitan_lite.data.tokenizer import build_tokenizer
from torchtitan_lite.models import registry
from torchtitan_lite.runtime.run_history import read_metrics


class BareLoop:
    """The same job as a researcher's loop, settings read from the trainer's resolved config; one step per call."""

    def __init__(self, argv: list[str]):
        cfg = load_config(argv)
        self.t, o = cfg.training, cfg.optimizer
        tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        source = build_source(self.t.dataset, self.t.dataset_path, self.t.seq_len, tokenizer, self.t.seed)
        self.loader = DataLoader(source, self.t.local_batch_size, self.t.local_batch_size, 0, 1)
        spec = registry.get(cfg.model.name)
        self.model = spec.model_class(spec.run_args(cfg, tokenizer.n_words))
        self.model.init_weights(seed=self.t.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                           weight_decay=o.weight_decay, foreach=True)
        self.times, self.losses = [], []

    def step(self) -> None:
        start = time.perf_counter()
        (inputs, labels), = self.loader.next_batch()
        loss = F.cross_entropy(self.model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.t.max_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.item())
        self.times.append(time.perf_counter() - start)


def interleaved_run(argv: list[str]) -> tuple[list[float], BareLoop, list[float]]:
    """One whole train.run() with one bare step run inside each of its steps.

    The trainer's data loader is swapped for one that first runs a bare step (the trainer's only per-step call we can
    hook without editing it), so the two alternate step by step and contention that comes and goes within seconds
    hits both alike. That bare step lies inside the trainer's logged step interval and is subtracted from it.
    Returns (the trainer's step times, the bare loop, the trainer's losses)."""
    bare: list[BareLoop] = []

    class Interleaved(DataLoader):
        def __init__(self, *args):
            super().__init__(*args)
            bare.append(BareLoop(argv))  # built during the trainer's start-up, which is not timed

        def next_batch(self):
            bare[0].step()
            return super().next_batch()

    gc_was_enabled = gc.isenabled()
    with tempfile.TemporaryDirectory() as dump, mock.patch.object(train, "DataLoader", Interleaved):
        code = train.run([*argv, "--job.dump_folder", dump])
        if code != 0:
            with open(logging.getLogger().handlers[0].baseFilename) as log:
                raise SystemExit(f"train.run failed with exit code {code}:\n{log.read()[-3000:]}")
        if len(bare) != 1:
            raise SystemExit(f"expected train.py to build one train.DataLoader, it built {len(bare)}: update the hook")
        rows = read_metrics(dump)
    if gc_was_enabled:
        gc.enable()  # the trainer turns automatic GC off (it collects every gc_freq steps) and leaves it off
    cfg = load_config(argv)
    tokens = cfg.training.local_batch_size * cfg.training.seq_len  # world size 1: global batch = local batch
    times = [tokens / r["tps"] - b for r, b in zip(rows, bare[0].times)]
    return times, bare[0], [r["loss"] for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="train.run() calls, each with a fresh bare loop inside")
    p.add_argument("--steps", type=int, default=20, help="timed steps per round, after the warm-up")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each round")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="local (= global) batch size")
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--tokenizer_path", default="", help='"" = byte level (258 ids)')
    a = p.parse_args()
    # Constant lr (no warmup, no decay), so the bare loop needs no schedule to follow the same curve.
    argv = ["--model.flavor", a.flavor, "--model.tokenizer_path", a.tokenizer_path, "--training.dataset", a.dataset,
            "--training.seq_len", str(a.seq_len), "--training.local_batch_size", str(a.batch),
            "--training.steps", str(a.warmup + a.steps), "--training.mixed_precision_param", "float32",
            "--optimizer.implementation", "foreach", "--lr_scheduler.warmup_steps", "0",
            "--lr_scheduler.decay_ratio", "0", "--metrics.log_freq", "1", "--no-checkpoint.enable",
            "--no-validation.enable", "--no-metrics.enable_tensorboard"]
    # The trainer logs every step as a real run does, into a file rather than over this benchmark's output.
    log_dir = tempfile.TemporaryDirectory()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        handlers=[logging.FileHandler(os.path.join(log_dir.name, "train.log"))])
    trainer, bare, max_loss_diff = [], [], 0.0
    for i in range(a.rounds):
        t_times, loop, t_losses = interleaved_run(argv)
        max_loss_diff = max(max_loss_diff, *(abs(x - y) for x, y in zip(t_losses, loop.losses)))
        if max_loss_diff > 1e-3:  # then the two do not do the same work, and their times are not comparable
            raise SystemExit(f"the two loops train differently: losses {t_losses} vs {loop.losses}")
        trainer += t_times[a.warmup:]
        bare += loop.times[a.warmup:]
        t_med, b_med = statistics.median(t_times[a.warmup:]), statistics.median(loop.times[a.warmup:])
        print(f"round {i + 1}: median step trainer {t_med * 1e3:.1f} ms, bare {b_med * 1e3:.1f} ms, "
              f"ratio {t_med / b_med:.3f}", flush=True)
    log_dir.cleanup()
    t_med, b_med = statistics.median(trainer), statistics.median(bare)
    paired = statistics.median(t / b for t, b in zip(trainer, bare))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.flavor} fp32, seq {a.seq_len} x batch "
          f"{a.batch}, {a.rounds} rounds of {a.warmup}+{a.steps} steps; largest loss difference {max_loss_diff:.2e}")
    print(f"median step time over {len(trainer)} steps: trainer {t_med * 1e3:.1f} ms, bare {b_med * 1e3:.1f} ms; "
          f"median of per-step ratios {paired:.3f}")
    print(f"trainer/bare step time: {t_med / b_med:.3f}")

if __name__ == "__main__":
    main()
