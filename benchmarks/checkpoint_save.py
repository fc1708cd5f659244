"""How fast checkpoints save and load, and what an async save costs training; one process, CPU.

    python benchmarks/checkpoint_save.py [--dim 1024] [--layers 4] [--folder ./outputs/checkpoint_bench]

For the debug model and a larger one (debugmodel with --dim and --layers), after a few real training steps so the
AdamW state exists, it measures through CheckpointManager (the trainer's code path):
- the state's tensor bytes against the checkpoint's size on disk;
- the disk's raw write speed: the checkpoint's bytes as one file, written and fsynced, as DCP fsyncs its files;
- a synchronous save and a load, in MB/s of checkpoint;
- an async save: the time training is blocked (the state is copied), and the training time lost in all: that plus
  the extra time of the steps that run while the copy is written, against the same steps without a save. A non-zero
  "wait at end" means those steps ended before the write did (the next save would wait that long).
Loads and the raw read run from the page cache (the file was just written), so they compare memory-speed reads.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import time

import torch
import torch.nn.functional as F

from torchtitan_lite.checkpoint.manager import CheckpointManager, TrainState
from torchtitan_lite.config import Checkpoint, LRScheduler
from torchtitan_lite.data.loader import DataLoader
from torchtitan_lite.data.synthetic import SyntheticSource
from torchtitan_lite.models.registry import get
from torchtitan_lite.runtime.precision import UpdateGuard
from torchtitan_lite.runtime.process import Env, init_distributed
from torchtitan_lite.training.optim import build_lr_scheduler

SEQ, BATCH, VOCAB = 64, 2, 258


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def raw_write_read(path: str, checkpoint: str) -> tuple[float, float]:
    """Seconds to write + fsync the checkpoint's bytes as one plain file (the same size and content: this VM's disk
    writes some contents faster than others), then to read it back."""
    data = b"".join(open(os.path.join(checkpoint, f), "rb").read() for f in sorted(os.listdir(checkpoint)))
    os.sync()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        f.read()
    read = time.perf_counter() - t0
    os.remove(path)
    return write, read


class Run:
    """A model, AdamW, schedule, data and a CheckpointManager, as train.py builds them (one process, fp32)."""

    def __init__(self, args, folder: str, async_mode: str):
        self.model = get("llama3").model_class(args)
        self.model.init_weights(seed=0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)
        self.scheduler = build_lr_scheduler(self.optimizer, LRScheduler(warmup_steps=2), 1000)
        self.data = DataLoader(SyntheticSource(SEQ, VOCAB, 0), BATCH, BATCH, 0, 1)
        self.state = TrainState()
        cfg = Checkpoint(enable=True, folder=os.path.basename(folder), async_mode=async_mode)
        self.ckpt = CheckpointManager(cfg, os.path.dirname(folder), self.model, self.optimizer, self.scheduler,
                                      self.data, self.state, UpdateGuard(torch.device("cpu"), torch.float32), 1000)

    def steps(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            for inputs, labels in self.data.next_batch():
                loss = F.cross_entropy(self.model(inputs).flatten(0, 1), labels.flatten())
                loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.state.step += 1
        return time.perf_counter() - t0

    def tensor_bytes(self) -> int:
        tensors = list(self.model.state_dict().values())
        tensors += [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def bench(name: str, args, root: str, train_steps: int) -> dict[str, float]:
    folder = os.path.join(root, name)
    shutil.rmtree(folder, ignore_errors=True)
    run = Run(args, folder, "disabled")
    run.steps(2)  # AdamW state exists, kernels are warm
    os.sync()  # each timed write starts with no other dirty pages to flush
    t0 = time.perf_counter()
    run.ckpt.save(run.state.step)
    sync_s = time.perf_counter() - t0
    disk = folder_bytes(os.path.join(folder, f"step-{run.state.step}"))
    raw_w, raw_r = raw_write_read(os.path.join(root, "raw.bin"), os.path.join(folder, f"step-{run.state.step}"))
    fresh = Run(args, folder, "disabled")
    t0 = time.perf_counter()
    fresh.ckpt.load()
    load_s = time.perf_counter() - t0
    assert fresh.state.step == run.state.step
    # Async: the same save, from a manager with async_mode; training runs on while the copy is written.
    arun = Run(args, folder + "_async", "async")
    arun.steps(2)
    base_s = arun.steps(train_steps)  # the same steps without a save in flight
    os.sync()
    t0 = time.perf_counter()
    arun.ckpt.save(arun.state.step)
    blocked_s = time.perf_counter() - t0
    during_s = arun.steps(train_steps)
    t1 = time.perf_counter()
    arun.ckpt.wait()
    waited_s = time.perf_counter() - t1
    shutil.rmtree(folder)
    shutil.rmtree(folder + "_async")
    mb = disk / 1e6
    return {"tensor_MB": run.tensor_bytes() / 1e6, "disk_MB": mb, "sync_s": sync_s, "sync_MBps": mb / sync_s,
            "raw_write_MBps": mb / raw_w, "load_s": load_s, "load_MBps": mb / load_s, "raw_read_MBps": mb / raw_r,
            "async_blocked_s": blocked_s, "async_lost_s": blocked_s + during_s - base_s,
            "step_s": base_s / train_steps, "train_steps": train_steps, "async_waited_s": waited_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--train_steps", type=int, default=6, help="steps run while the async save is written")
    p.add_argument("--repeats", type=int, default=3, help="each figure is the median of this many runs")
    p.add_argument("--folder", default="./outputs/checkpoint_bench")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    init_distributed(Env.from_environ())
    os.makedirs(a.folder, exist_ok=True)
    base = get("llama3").args("debugmodel", VOCAB, SEQ)
    models = {"debugmodel": base, f"dim{a.dim}x{a.layers}": base.with_(dim=a.dim, n_layers=a.layers)}
    rows = {}
    for name, args in models.items():
        runs = [bench(name, args, a.folder, a.train_steps) for _ in range(a.repeats)]
        rows[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, folder {os.path.abspath(a.folder)}, "
          f"median of {a.repeats}")
    fmt = "{:<28}" + "{:>16}" * len(rows)
    print(fmt.format("", *rows))
    lines = [
        ("tensor bytes (MB)", "tensor_MB", "{:.1f}"), ("size on disk (MB)", "disk_MB", "{:.1f}"),
        ("raw write+fsync (MB/s)", "raw_write_MBps", "{:.0f}"), ("sync save (s)", "sync_s", "{:.3f}"),
        ("sync save (MB/s)", "sync_MBps", "{:.0f}"), ("raw read, cached (MB/s)", "raw_read_MBps", "{:.0f}"),
        ("load (s)", "load_s", "{:.3f}"), ("load (MB/s)", "load_MBps", "{:.0f}"),
        ("train step (s)", "step_s", "{:.3f}"), ("async: blocked (s)", "async_blocked_s", "{:.3f}"),
        ("async: training lost (s)", "async_lost_s", "{:.3f}"), ("async: wait at end (s)", "async_waited_s", "{:.3f}"),
    ]
    for label, key, f in lines:
        print(fmt.format(label, *(f.format(r[key]) for r in rows.values())))
    torch.distributed.destroy_process_group()
    if not os.listdir(a.folder):
        os.rmdir(a.folder)


if __name__ == "__main__":
    main()
