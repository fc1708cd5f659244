"""How fast each data source delivers tokens on this machine (one process), and what share of a training step the
debug run spends waiting for data.

    python benchmarks/data_throughput.py [--seq_len 256] [--run_dir outputs]

Per source: the startup cost (reading and tokenizing; none for synthetic and shards) and windows() throughput over
the loader's access pattern (consecutive global positions, which the shuffle scatters over the corpus), and three of
them in a mixture (data/mixture.py) beside one alone. Then the debug run's data wait: DataLoader.next_batch() for one
rank (local batch 4, dp 2), on one source and on the mixture, against the step time of the debug model, measured here in one process or, with --run_dir, read from a finished run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan_lite.data import files as datasets
from torchtitan_lite.data.loader import DataLoader, build_source
from torchtitan_lite.data.mixture import MixtureSource
from torchtitan_lite.data.tokenizer import STDLIB_BPE, Tokenizer
from torchtitan_lite.models.registry import get
from torchtitan_lite.runtime.run_history import read_metrics


def windows_per_second(source, batch: int, seconds: float = 2.0) -> float:
    position, n, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        source.windows(torch.arange(position, position + batch))
        position, n = position + batch, n + batch
    return n / (time.perf_counter() - start)


def build_timed(*args, **kwargs):
    start = time.perf_counter()
    source = build_source(*args, **kwargs)
    return source, time.perf_counter() - start


def step_seconds(tok: Tokenizer, seq_len: int, local_batch: int, steps: int = 5) -> float:
    """A training step of the debug model on one process: forward, backward, AdamW."""
    model = get("llama3").model_class(get("llama3").args("debugmodel", tok.n_words, seq_len))
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, tok.n_words, (local_batch, seq_len + 1))
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first step pays for allocation


def run_step_seconds(run_dir: Path) -> float:
    """The median step time of a finished run (from metrics.jsonl, logged every step)."""
    rows = read_metrics(run_dir)
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:]) if b["step"] == a["step"] + 1]
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq_len", type=int, default=256, help="the debug run's")
    p.add_argument("--batch", type=int, default=8, help="windows per windows() call (the debug run's global batch)")
    p.add_argument("--run_dir", type=Path, help="a finished ./run_train.sh dump folder, to quote its step time")
    args = p.parse_args()
    torch.set_num_threads(1)  # a data loader shares the CPU with training; measure what one core does
    bpe = Tokenizer.from_file(STDLIB_BPE)
    seq_len = args.seq_len

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # The standard library as JSON lines and as shards: the same 12 MB through each path.
        files = datasets.corpus_files("python_stdlib", "", "train", "")
        with open(tmp / "stdlib.jsonl", "w") as f:
            for path in files:
                f.write(json.dumps({"text": path.read_text(errors="replace")}) + "\n")
        (tmp / "shards").mkdir()
        for i, path in enumerate(files):
            docs = datasets.read_documents(path, "text", "text")
            datasets.write_shard(tmp / "shards" / f"{i:05d}.bin", iter([datasets.tokenize_documents(docs, bpe)]), bpe)

        specs = {  # name -> build_source's (dataset, dataset_path)
            "synthetic": ("synthetic", ""),
            "python_stdlib": ("python_stdlib", ""),
            "jsonl": ("jsonl", str(tmp / "stdlib.jsonl")),
            "tokens (mmap)": ("tokens", str(tmp / "shards")),
        }
        parts = {}
        print(f"windows(), {args.batch} per call, stdlib BPE, one process; startup = reading and tokenizing")
        print(f"{'source':<16}{'startup':>10}{f'tokens/s at seq_len {seq_len}':>28}{'at seq_len 2048':>18}")
        for name, (dataset, path) in specs.items():
            source, startup = build_timed(dataset, path, seq_len, bpe, 0)
            rate = windows_per_second(source, args.batch) * (seq_len + 1)
            long_rate = windows_per_second(build_source(dataset, path, 2048, bpe, 0), args.batch) * 2049
            print(f"{name:<16}{startup:>9.2f}s{rate:>28.3g}{long_rate:>18.3g}")
            if dataset == "python_stdlib":
                stdlib = source
            parts[name] = source
        # Three of them mixed 5:3:2 (data/mixture.py): what sorting each batch's windows by source costs.
        mixture = MixtureSource({"code": parts["python_stdlib"], "synthetic": parts["synthetic"],
                                 "shards": parts["tokens (mmap)"]}, [(0, {"code": 5, "synthetic": 3, "shards": 2})],
                                global_batch=args.batch)
        plain_rate = windows_per_second(parts["python_stdlib"], args.batch) * (seq_len + 1)
        mixed_rate = windows_per_second(mixture, args.batch) * (seq_len + 1)
        print(f"{'mixture 5:3:2':<16}{'':>10}{mixed_rate:>28.3g}   (python_stdlib alone, side by side: "
              f"{plain_rate:.3g})")

    # The debug run: per rank, local batch 4 of a global batch of 8 (dp 2), on one source and on the mixture.
    step = run_step_seconds(args.run_dir) if args.run_dir else step_seconds(bpe, seq_len, local_batch=4)
    where = f"run {args.run_dir}" if args.run_dir else "debug model, local batch 4, one process"
    print(f"\ndebug run: step {step * 1e3:.0f} ms ({where})")
    for name, source in (("python_stdlib", stdlib), ("mixture 5:3:2", mixture)):
        loader = DataLoader(source, global_batch=8, local_batch=4, dp_rank=1, dp_size=2)
        start = time.perf_counter()
        for _ in range(200):
            loader.next_batch()
        wait = (time.perf_counter() - start) / 200
        print(f"  {name:<14} next_batch() {wait * 1e3:.2f} ms: data is {100 * wait / step:.2g}% of the step")

if __name__ == "__main__":
    main()
