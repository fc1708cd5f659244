"""Trains a byte-level BPE and writes it as a tiktoken file (`base64(token) rank` per line).

    python scripts/train_tokenizer.py --dataset jsonl --dataset_path 'data/*.jsonl.gz' --text_field text \
        --vocab_size 8192 --output my_bpe.tiktoken
    python scripts/train_tokenizer.py --input 'data/**/*.txt' notes.md --output my_bpe.tiktoken
    python scripts/train_tokenizer.py --input stdlib --vocab_size 2048 \
        --output torchtitan_lite/assets/stdlib_bpe_2k.tiktoken

`--dataset`, `--dataset_path`, `--split` and `--text_field` read a corpus exactly as scripts/pretokenize.py and the
trainer read it: a JSON lines file trains on its text field, never on its JSON syntax. `--input` takes plain-text
files and globs, or `stdlib`: the whole standard library, validation split included, which is how the project's
asset was made (python_stdlib's train split leaves every 50th file out).

Ranks 0..255 are the single bytes, then one token per merge in the order learned, which is the order tiktoken
applies them. Text is pre-tokenized with Llama 3's regex (the one `Tokenizer` uses), so a merge never crosses a
pre-token. Training is deterministic: equal pair counts are broken by the pair's bytes, so the same input always
gives the same file.
"""

from __future__ import annotations

import argparse
import base64
import glob
import heapq
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Iterator

import regex  # a dependency of tiktoken, so always installed with it; Python's `re` has no \p{L}

from torchtitan_lite.config import ConfigError
from torchtitan_lite.data import files as datasets
from torchtitan_lite.data.tokenizer import LLAMA3_PAT, Tokenizer


def input_files(specs: list[str]) -> list[Path]:
    files: list[Path] = []
    for spec in specs:
        if spec == "stdlib":
            found = datasets.stdlib_files()
        else:
            found = [Path(p) for p in sorted(glob.glob(spec, recursive=True)) if Path(p).is_file()]
        if not found:
            raise ConfigError(f"--input {spec!r} matches no file")
        jsonl = next((f for f in found if f.name.endswith((".jsonl", ".jsonl.gz"))), None)
        if jsonl:  # read as text, its keys and quotes would become merges
            raise ConfigError(f"--input reads plain text and {jsonl} is JSON lines: use --dataset jsonl "
                              f"--dataset_path {spec!r} [--text_field FIELD]")
        files += [f for f in found if f not in files]
    return files


def documents(args: argparse.Namespace) -> Iterator[str]:
    """The corpus's documents in order, read as pretokenize.py and the trainer read them."""
    if args.input:
        files, kind = input_files(args.input), "text"
    else:
        files = datasets.corpus_files(args.dataset, args.dataset_path, args.split, "--dataset_path")
        kind = "jsonl" if args.dataset == "jsonl" else "text"
    for f in files:
        yield from datasets.read_documents(f, kind, args.text_field)


def read_texts(docs: Iterable[str], max_bytes: int) -> list[str]:
    """The documents in order, the last one cut so that the total is at most max_bytes of UTF-8."""
    texts, left = [], max_bytes
    for doc in docs:
        if left <= 0:
            break
        data = doc.encode("utf-8")[:left]
        left -= len(data)
        texts.append(data.decode("utf-8", errors="replace"))  # a cut may split a character
    return texts


def count_words(texts: list[str]) -> Counter[bytes]:
    split = regex.compile(LLAMA3_PAT)
    words: Counter[str] = Counter()
    for text in texts:
        words.update(split.findall(text))
    return Counter({w.encode("utf-8"): n for w, n in words.items()})


def merge(word: list[int], pair: tuple[int, int], new: int) -> list[int]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(word_counts: dict[bytes, int], vocab_size: int) -> list[bytes]:
    """Returns the tokens in rank order. Pair counts are kept up to date incrementally: a merge only revisits the
    words that contain the pair (found through `where`), instead of recounting the whole corpus."""
    tokens = [bytes([i]) for i in range(256)]
    token_id = {t: i for i, t in enumerate(tokens)}
    words = [list(w) for w in word_counts]
    counts = list(word_counts.values())
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)  # may hold stale words; merge() then changes nothing
    for i, w in enumerate(words):
        for pair in zip(w, w[1:]):
            pair_counts[pair] += counts[i]
            where[pair].add(i)

    # A max-heap on (count, then smallest bytes first). Counts change after each merge, so entries may be stale:
    # a popped entry is used only if its count is still current.
    def entry(pair):
        return (-pair_counts[pair], tokens[pair[0]], tokens[pair[1]], pair)

    heap = [entry(p) for p in pair_counts]
    heapq.heapify(heap)
    while len(tokens) < vocab_size and heap:
        neg_count, _, _, pair = heapq.heappop(heap)
        if neg_count == 0 or -neg_count != pair_counts.get(pair):
            continue
        merged = tokens[pair[0]] + tokens[pair[1]]
        # Two merge paths can build the same bytes ("ab"+"c", "a"+"bc"); tiktoken has one rank per byte string.
        if merged not in token_id:
            token_id[merged] = len(tokens)
            tokens.append(merged)
        new = token_id[merged]
        changed = set()
        for i in where.pop(pair):
            old = words[i]
            words[i] = w = merge(old, pair, new)
            if len(w) == len(old):
                continue
            for p in zip(old, old[1:]):
                pair_counts[p] -= counts[i]
                changed.add(p)
            for p in zip(w, w[1:]):
                pair_counts[p] += counts[i]
                where[p].add(i)
                changed.add(p)
        del pair_counts[pair]
        changed.discard(pair)
        for p in changed:
            if pair_counts[p] > 0:
                heapq.heappush(heap, entry(p))
    return tokens


def write_tiktoken(tokens: list[bytes], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)]
    path.write_text("".join(lines))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", choices=("python_stdlib", "text", "jsonl"), help="a corpus, as pretokenize.py "
                        "reads it")
    source.add_argument("--input", nargs="+", help="plain-text files, globs ('**' recurses), or 'stdlib' (all of it)")
    p.add_argument("--dataset_path", default="", help="files, globs or folders, comma-separated")
    p.add_argument("--split", default="train", choices=("train", "validation"), help="python_stdlib's split")
    p.add_argument("--text_field", default="text", help="jsonl: the field that holds a document's text")
    p.add_argument("--vocab_size", type=int, default=2048, help="ranks, the 256 bytes included (BOS/EOS come on top)")
    p.add_argument("--max_bytes", type=int, default=20_000_000, help="read at most this much input")
    p.add_argument("--output", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.vocab_size < 256:
        p.error("--vocab_size must be at least 256 (the single bytes)")

    start = time.perf_counter()
    try:
        texts = read_texts(documents(args), args.max_bytes)
    except (ConfigError, OSError) as e:  # no such file, a JSON line without the text field, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    words = count_words(texts)
    counted = time.perf_counter()
    tokens = train_bpe(words, args.vocab_size)
    write_tiktoken(tokens, args.output)
    done = time.perf_counter()
    if len(tokens) < args.vocab_size:
        print(f"warning: the input only supports {len(tokens)} tokens, fewer than --vocab_size {args.vocab_size}")

    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    tok = Tokenizer.from_file(args.output)
    n_tokens = sum(len(tok.encode(t, bos=False, eos=False)) for t in texts)
    print(f"read {len(texts)} documents, {n_bytes / 1e6:.2f} MB: {len(words)} distinct pre-tokens "
          f"({counted - start:.1f}s)")
    print(f"learned {len(tokens) - 256} merges in {done - counted:.1f}s; wrote {args.output} (identity {tok.identity})")
    print(f"on the input: {n_bytes / n_tokens:.2f} bytes/token (byte-level: 1.00), {n_tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
