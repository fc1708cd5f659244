"""Tokenizes a corpus once into memory-mapped shards, for `training.dataset = "tokens"` (the path for large corpora:
no tokenization at train time, constant memory, random access, resharding on resume).

    python scripts/pretokenize.py --dataset jsonl --dataset_path 'data/*.jsonl.gz' --text_field text \\
        --tokenizer_path torchtitan_lite/assets/stdlib_bpe_2k.tiktoken --output data/tokens
    python scripts/pretokenize.py --dataset python_stdlib --tokenizer_path '' --output data/stdlib_bytes

then train with `--training.dataset tokens --training.dataset_path data/tokens` and the same tokenizer. Input files
are tokenized in parallel, one shard per input file (`00000000.bin`, ...), so the shards in name order hold exactly
the token stream that training on the files directly would read. Each shard starts with a header naming its
tokenizer; training with another tokenizer is an error.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

from torchtitan_lite.config import ConfigError
from torchtitan_lite.data import files as datasets
from torchtitan_lite.data.tokenizer import build_tokenizer

_tokenizer = None  # one per worker process, built once


def _init_worker(tokenizer_path: str) -> None:
    global _tokenizer
    _tokenizer = build_tokenizer(tokenizer_path)


def _tokenize_file(job: tuple[int, Path, str, str, Path]) -> tuple[int, int]:
    index, path, kind, text_field, output = job
    # One document at a time: a worker's memory stays small whatever the file's size.
    chunks = (datasets.tokenize_documents(iter([doc]), _tokenizer)
              for doc in datasets.read_documents(path, kind, text_field))
    n_tokens = datasets.write_shard(output / f"{index:08d}.bin", chunks, _tokenizer)
    return path.stat().st_size, n_tokens


def fail(message: str):
    """Bad input: one line and exit 2, as the trainer and the other scripts answer it."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True, choices=("python_stdlib", "text", "jsonl"))
    p.add_argument("--dataset_path", default="", help="files, globs or folders, comma-separated")
    p.add_argument("--split", default="train", choices=("train", "validation"), help="python_stdlib's split")
    p.add_argument("--text_field", default="text", help="jsonl: the field that holds a document's text")
    p.add_argument("--tokenizer_path", required=True, help="tiktoken file, or '' for the byte-level tokenizer")
    p.add_argument("--output", type=Path, required=True, help="folder for the shards (must hold none yet)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="processes tokenizing files in parallel")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)

    try:
        tokenizer = build_tokenizer(args.tokenizer_path)
        files = datasets.corpus_files(args.dataset, args.dataset_path, args.split, "--dataset_path")
    except (ConfigError, OSError, ValueError) as e:
        fail(str(e))
    args.output.mkdir(parents=True, exist_ok=True)
    if any(args.output.glob("*.bin")):
        # Old shards would silently join the new corpus: the trainer reads every shard in the folder.
        fail(f"{args.output} already holds .bin shards: pick an empty folder")

    kind = "jsonl" if args.dataset == "jsonl" else "text"
    jobs = [(i, f, kind, args.text_field, args.output) for i, f in enumerate(files)]
    start, shown, n_bytes, n_tokens = time.perf_counter(), 0.0, 0, 0
    total_bytes = sum(f.stat().st_size for f in files)
    try:
        with multiprocessing.Pool(max(1, min(args.workers, len(files))), _init_worker, (args.tokenizer_path,)) as pool:
            # imap keeps file order in the results; chunksize 1 keeps a few huge files from queueing on one worker.
            for done, (size, tokens) in enumerate(pool.imap(_tokenize_file, jobs), start=1):
                n_bytes, n_tokens = n_bytes + size, n_tokens + tokens
                elapsed = time.perf_counter() - start
                if elapsed < shown + 0.5 and done < len(files):  # a few updates a second are enough
                    continue
                shown = elapsed
                print(f"\r{done}/{len(files)} files  {n_bytes / 1e6:,.1f}/{total_bytes / 1e6:,.1f} MB  "
                      f"{n_tokens / 1e6:,.2f}M tokens  {n_bytes / 1e6 / elapsed:.1f} MB/s", end="", file=sys.stderr)
    except (ConfigError, OSError) as e:  # e.g. a JSON line without the text field, raised in a worker
        for i, _, _, _, _ in jobs:  # no partial corpus left behind to be trained on by mistake
            for leftover in (args.output / f"{i:08d}.bin", args.output / f"{i:08d}.bin.tmp"):
                leftover.unlink(missing_ok=True)
        print(file=sys.stderr)  # ends the progress line
        fail(str(e))
    print(file=sys.stderr)
    if n_tokens == 0:
        fail(f"{args.dataset_path or args.dataset} holds no text")
    print(f"wrote {len(files)} shards, {n_tokens:,} tokens (tokenizer {tokenizer.identity}) to {args.output} "
          f"in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
