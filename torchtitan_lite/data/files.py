"""Where training text comes from and how it becomes tokens: files on disk, the interpreter's standard library,
pre-tokenized shards, and Hugging Face streams. loader.py packs the tokens into windows and orders them.

Every document is encoded as BOS + tokens + EOS; empty documents are skipped. A plain text file is one document; a
JSON lines file holds one document per line, in the field `training.dataset_text_field`.
"""

from __future__ import annotations

import array
import fcntl
import glob
import gzip
import hashlib
import json
import logging
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

import torch

from torchtitan_lite.config import ConfigError
from torchtitan_lite.config.paths import cache_dir

# Token shards (scripts/pretokenize.py): a fixed-size header, then the tokens as little-endian uint16 or uint32.
# The header is JSON padded with spaces, so `head -c 256 shard.bin` shows what a shard holds.
SHARD_MAGIC = b"TTLITE-TOKENS\n"
SHARD_VERSION = 1
HEADER_BYTES = 256  # a multiple of 4, so the tokens after it are aligned for a zero-copy view
_TYPECODES = {"uint16": "H", "uint32": "I"}  # array module typecodes, both of exactly that size on every platform
_TORCH_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}
STDLIB_HOLDOUT = 50  # python_stdlib: every 50th file is validation data, never trained on
assert sys.byteorder == "little", "token shards are little-endian"
logger = logging.getLogger("torchtitan_lite")


def stdlib_files() -> list[Path]:
    """The running interpreter's standard library, sorted. Tests are left out (synthetic data, often stripped from
    installs), and so is site-packages (third-party, differs per machine)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    found = []  # relative paths as tuples of parts, which sort as Path objects do
    # os.walk, not Path.rglob: far faster (docs/performance.md), and every rank of every run pays it.
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in skip]
        parts = Path(folder).relative_to(root).parts
        found += [(*parts, n) for n in names if n.endswith(".py")]
    return [Path(root, *p) for p in sorted(found)]


def expand_paths(spec: str, key: str, dir_pattern: str = "*") -> list[Path]:
    """Comma-separated files, globs ('**' recurses) and folders (their `dir_pattern` files, recursively), in the
    order given, each sorted, each file once."""
    if not spec.strip():
        raise ConfigError(f"{key} is empty: set it to files, globs or a folder (comma-separated)")
    files: list[Path] = []
    seen: set[Path] = set()  # not a scan of `files`: a large corpus has 10^5 shards
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        path = Path(part).expanduser()
        if any(c in part for c in "*?["):
            found = sorted(Path(p) for p in glob.glob(os.path.expanduser(part), recursive=True))
        elif path.is_dir():
            found = sorted(path.rglob(dir_pattern))
        elif path.exists():
            found = [path]
        else:
            raise ConfigError(f"{key}: {path.absolute()} does not exist")
        found = [f for f in found if f.is_file() and not f.name.startswith(".")]
        if not found:
            raise ConfigError(f"{key}: {str(path.absolute())!r} matches no file")
        for f in found:
            if f not in seen:
                seen.add(f)
                files.append(f)
    return files


def corpus_files(name: str, path: str, split: str, key: str) -> list[Path]:
    """The files of a `python_stdlib`, `text`, `jsonl` or `tokens` corpus, in stream order."""
    if name != "python_stdlib":
        return expand_paths(path, key, dir_pattern="*.bin" if name == "tokens" else "*")
    if path:
        raise ConfigError(f"{key} must be empty for python_stdlib (it reads this interpreter's standard library)")
    files = stdlib_files()
    held_out = split != "train"
    return [f for i, f in enumerate(files) if (i % STDLIB_HOLDOUT == STDLIB_HOLDOUT - 1) == held_out]


def _open_text(path: Path):
    # errors="replace": a stray invalid byte should cost one character, not the run.
    opener = gzip.open if path.suffix == ".gz" else open
    return opener(path, "rt", encoding="utf-8", errors="replace", newline="")


def read_documents(path: Path, kind: str, text_field: str) -> Iterator[str]:
    """The documents of one file: the whole file for `text`, one per line for `jsonl` (`.gz` files are read too)."""
    with _open_text(path) as f:
        if kind != "jsonl":
            yield f.read()
            return
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise ConfigError(f"{path}:{n}: not a JSON object ({line[:60]!r})") from None
            text = row.get(text_field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"{path}:{n}: no string field {text_field!r} (set training.dataset_text_field, "
                                  f"or the scripts' --text_field, to the field that holds the text)")
            yield text


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenize_documents(docs: Iterator[str], tokenizer) -> array.array:
    """One flat array of BOS + tokens + EOS per non-empty document."""
    out = array.array(_TYPECODES[token_dtype(tokenizer.n_words)])
    for text in docs:
        if text:
            out.extend(tokenizer.encode(text, bos=True, eos=True))
    return out


def as_tensor(tokens: array.array) -> torch.Tensor:
    dtype = torch.uint16 if tokens.typecode == "H" else torch.uint32
    return torch.frombuffer(tokens, dtype=dtype) if len(tokens) else torch.empty(0, dtype=dtype)


# ---- Token shards


def write_shard(path: Path, chunks: Iterator[array.array], tokenizer) -> int:
    """Writes `chunks` (arrays of the tokenizer's token dtype) as one shard, atomically; returns the token count."""
    dtype = token_dtype(tokenizer.n_words)
    tmp = path.with_name(path.name + ".tmp")
    n_tokens, max_token = 0, -1
    with open(tmp, "wb") as f:
        f.write(b" " * HEADER_BYTES)  # rewritten below, once the count is known: chunks stream, memory stays small
        for chunk in chunks:
            assert chunk.typecode == _TYPECODES[dtype]
            if len(chunk):
                chunk.tofile(f)
                n_tokens, max_token = n_tokens + len(chunk), max(max_token, max(chunk))
        meta = {"version": SHARD_VERSION, "dtype": dtype, "n_tokens": n_tokens, "max_token": max_token,
                "vocab_size": tokenizer.n_words, "tokenizer": tokenizer.identity}
        header = SHARD_MAGIC + json.dumps(meta).encode()
        assert len(header) < HEADER_BYTES
        f.seek(0)
        f.write(header.ljust(HEADER_BYTES - 1) + b"\n")
    os.replace(tmp, path)  # a killed writer leaves a .tmp file, never a shard that looks complete
    return n_tokens


def read_shard_header(path: Path) -> dict:
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if not head.startswith(SHARD_MAGIC):
        raise ConfigError(f"{path} is not a token shard (write shards with scripts/pretokenize.py)")
    try:
        meta = json.loads(head[len(SHARD_MAGIC):])
    except ValueError:
        raise ConfigError(f"{path} has a corrupt header") from None
    if meta.get("version") != SHARD_VERSION or meta.get("dtype") not in _TYPECODES:
        raise ConfigError(f"{path} is a shard of format {meta.get('version')}/{meta.get('dtype')}; this version "
                          f"reads format {SHARD_VERSION}: rewrite it with scripts/pretokenize.py")
    return meta


def open_shard(path: Path, tokenizer) -> torch.Tensor:
    """The shard's tokens, memory-mapped: opening costs no memory and reading a window touches only its pages."""
    meta = read_shard_header(path)
    n, dtype = meta["n_tokens"], _TORCH_DTYPES[meta["dtype"]]
    size = HEADER_BYTES + n * dtype.itemsize
    if path.stat().st_size != size:
        raise ConfigError(f"{path} should be {size} bytes for its {n} tokens but is {path.stat().st_size}: "
                          f"it is truncated or was modified; rewrite it with scripts/pretokenize.py")
    if meta["max_token"] >= tokenizer.n_words:
        raise ConfigError(f"{path} holds token id {meta['max_token']} (its tokenizer has {meta['vocab_size']} ids) "
                          f"but the model's vocabulary has {tokenizer.n_words}: set model.tokenizer_path to the "
                          f"tokenizer the shards were written with")
    if meta["tokenizer"] != tokenizer.identity:
        raise ConfigError(f"{path} was written with tokenizer {meta['tokenizer']} but model.tokenizer_path gives "
                          f"tokenizer {tokenizer.identity}: use the same tokenizer file, or rewrite the shards")
    if n == 0:
        return torch.empty(0, dtype=dtype)
    # shared=False maps the file copy-on-write: read-only files work, and nothing is ever written back.
    data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    return data[HEADER_BYTES:].view(dtype)


# ---- The built-in corpus, tokenized once per machine


def cached_tokens(files: list[Path], tokenizer) -> torch.Tensor:
    """The tokens of text files, read from a token shard in cache_dir() when one exists, else tokenized and kept.

    Every rank of every run used to tokenize the standard library at start (seconds per rank). The shard is named by
    a hash of the tokenizer and each file's path, size and modification time, so an edited file, another tokenizer or
    another interpreter gets a shard of its own. Ranks and runs that start together queue on a lock: the first
    tokenizes, the others map its shard. A folder that cannot be written costs only the time, never the run.
    """
    key = hashlib.sha256(tokenizer.identity.encode())
    for f in files:
        stat = f.stat()
        key.update(f"{f.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    path = cache_dir() / f"{key.hexdigest()[:32]}.bin"

    def docs() -> Iterator[str]:
        return (doc for f in files for doc in read_documents(f, "text", ""))

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():  # write_shard publishes by rename: a shard that exists is complete
                logger.warning("tokenizing %d files once for this machine (cached in %s for later runs)",
                               len(files), path.parent)
                write_shard(path, [tokenize_documents(docs(), tokenizer)], tokenizer)
        return open_shard(path, tokenizer)
    except (OSError, ConfigError) as e:  # read-only or full disk, a lock the filesystem refuses, a damaged shard
        logger.warning("tokenizing without the cache (%s: %s)", path, e)
        return as_tensor(tokenize_documents(docs(), tokenizer))


# ---- Hugging Face streams


def load_hf_stream(spec: str, split: str, text_field: str, key: str):
    """`datasets.load_dataset` in streaming mode; spec is `PATH` or `PATH:CONFIG` (e.g. `allenai/c4:en`). Reads the
    first document, so that a wrong name or text field fails now rather than after the model is built."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{key}: dataset 'hf' needs the optional `datasets` package (pip install datasets)") from None
    if not spec:
        raise ConfigError(f"{key} is empty: name a Hugging Face dataset, e.g. HuggingFaceFW/fineweb-edu:sample-10BT")
    path, _, name = spec.partition(":")
    try:
        stream = datasets.load_dataset(path, name or None, split=split, streaming=True)
        first = next(iter(stream), None)
    except Exception as e:  # datasets raises many types (FileNotFoundError, ValueError, its own); all mean "bad spec"
        raise ConfigError(f"{key}: cannot stream {spec!r} split {split!r}: {e}") from None
    if first is None:
        raise ConfigError(f"{key}: {spec!r} split {split!r} holds no documents")
    if not isinstance(first.get(text_field), str):
        raise ConfigError(f"{key}: the documents of {spec!r} have no string field {text_field!r} (they have "
                          f"{', '.join(first)}): set training.dataset_text_field")
    return stream


class HFDocuments:
    """This rank's documents, endlessly: its shard of the stream, then again from the start.

    `position` is where the next document starts, as the dataset's own state_dict (datasets >= 2.18) in JSON, so a
    resume seeks there (skipping whole files) instead of reading every document consumed before; "" when the
    dataset keeps no state, or keeps one that does not advance (datasets 5.0 stopped tracking after a resume), and
    the caller then counts documents instead.
    """

    def __init__(self, dataset, text_field: str, dp_rank: int, dp_size: int, position: str = ""):
        from datasets.distributed import split_dataset_by_node

        self.split = lambda: split_dataset_by_node(dataset, rank=dp_rank, world_size=dp_size)
        self.text_field, self.dp_rank, self.dp_size = text_field, dp_rank, dp_size
        self.tracks = hasattr(dataset, "state_dict")
        self.position, self.shard = position if self.tracks else "", None
        self.texts = self._texts()

    def __iter__(self) -> "HFDocuments":
        return self

    def __next__(self) -> str:
        text = next(self.texts)
        if self.tracks:
            try:
                self.position = json.dumps(self.shard.state_dict())
            except TypeError:  # a state that is not plain data: count documents instead
                self.tracks, self.position = False, ""
        return text

    def _texts(self) -> Iterator[str]:
        resume = self.position
        while True:
            # A split of its own per pass: datasets applies a loaded state to every pass of its epoch, not the first.
            self.shard = self.split()
            fresh = json.dumps(self.shard.state_dict()) if self.tracks else ""
            if resume:
                self.shard.load_state_dict(json.loads(resume))
            empty = True
            for n, row in enumerate(self.shard):
                text = row.get(self.text_field)
                if not isinstance(text, str):
                    raise ConfigError(f"document {n} of the stream (dp rank {self.dp_rank}) has no string field "
                                      f"{self.text_field!r}: set training.dataset_text_field (fields: "
                                      f"{', '.join(row)})")
                if empty and self.tracks and json.dumps(self.shard.state_dict()) == fresh:
                    self.tracks, self.position = False, ""  # a document read and the state still at the start
                empty = False
                yield text
            if empty and not resume:
                raise ConfigError(f"the stream's shard for dp rank {self.dp_rank} of {self.dp_size} holds no "
                                  "documents")
            resume = ""  # a resumed pass may be empty: its state was saved after its last document
