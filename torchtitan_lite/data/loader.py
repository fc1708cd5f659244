"""Data: sources of token windows in one global order, and the loader that hands each rank its slice.

Every source defines a global sequence of windows of seq_len + 1 tokens (inputs and labels shifted by one). At
step s the global batch is windows [s*G, (s+1)*G) of that order, whatever the data-parallel degree; dp rank r takes
a contiguous slice of it. The loader's whole state is its position in the order, so a resume continues with the
exact next sample, also on a different number of data-parallel ranks.

Text is packed: documents (BOS + tokens + EOS, files.py) are concatenated into one stream, cut into windows back
to back with stride seq_len + 1, so each token is in exactly one window per epoch. No padding; windows cross
document boundaries; a tail shorter than a window is dropped. A finite source reshuffles its windows every epoch
(the first included) with a seeded permutation that needs no memory, so the order extends forever.

Hugging Face streams cannot be read at random positions: each dp rank streams its own shard of the documents, and
the state is per rank, so such a run resumes only on the same data-parallel degree. A resume seeks with the stream's
own state where the dataset keeps one, else it reads (untokenized) every document consumed before.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from torchtitan_lite.config import ConfigError, Training, Validation
from torchtitan_lite.data import files as datasets
from torchtitan_lite.data.digest import check_digest, digest
from torchtitan_lite.data.synthetic import SyntheticSource
from torchtitan_lite.models.init import key_words, mix32

logger = logging.getLogger("torchtitan_lite")
# Validation that follows text, jsonl or tokens data reads every 50th window of its stream, which training then skips.
HOLDOUT = 50


class Permutation:
    """A seeded bijection of [0, n) in O(1) memory, so 10^9 windows need no 8 GB randperm.

    A 4-round Feistel network, its round function init.py's integer hash, permutes [0, 4^h) for the smallest
    4^h >= n; a value that lands outside [0, n) is permuted again until it is inside ("cycle walking"), which stays a
    bijection and takes < 4 rounds on average. Python ints, not tensors: a batch needs a few dozen values, and for
    those the interpreter is faster than launching tensor ops (docs/performance.md).
    """

    rounds = 4

    def __init__(self, n: int, key: str):
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # bits per Feistel half
        self.mask = (1 << self.half) - 1
        self.keys = [key_words(f"{key}/{r}")[0] for r in range(self.rounds)]

    def __call__(self, i: int) -> int:
        x = self._feistel(i)
        while x >= self.n:
            x = self._feistel(x)
        return x

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (mix32(right ^ k) & self.mask)
        return (left << self.half) | right


class TokenSource:
    """Windows cut from a token stream held in chunks (an in-memory array, or memory-mapped shards in order).

    Window p of the global order is window perm_e(p mod n) of `part` of the stream, epoch e = p // n. The part is all
    its windows, or where validation follows the training data every HOLDOUT-th ("validation") or the others
    ("train"): windows of the stream, not of the order, so the split is the same for every layout and seed.
    """

    def __init__(self, chunks: list[torch.Tensor], seq_len: int, seed: int, what: str, part: str = "all"):
        self.chunks = [c for c in chunks if len(c)]
        self.offsets = [0, *itertools.accumulate(len(c) for c in self.chunks)]  # stream position of each chunk
        self.length, self.seed, self.what, self.part = seq_len + 1, seed, what, part
        self.n_tokens = self.offsets[-1]
        windows = self.n_tokens // self.length
        self.n = {"all": windows, "train": windows - windows // HOLDOUT, "validation": windows // HOLDOUT}[part]
        if self.n == 0 and part == "validation":
            raise ConfigError(f"{what} holds {windows} windows of seq_len + 1 = {self.length} tokens, too few to hold "
                              f"out every {HOLDOUT}th for validation: add data, set validation.dataset, or turn "
                              "validation off")
        if self.n == 0:
            raise ConfigError(f"{what} holds {self.n_tokens} tokens, fewer than one window of seq_len + 1 = "
                              f"{self.length}: add data or lower training.seq_len")

    def hold_out(self) -> tuple[TokenSource, TokenSource]:
        """(training part, validation part) of the same tokens: nothing is read or tokenized again."""
        seq_len = self.length - 1
        return (TokenSource(self.chunks, seq_len, self.seed, self.what, "train"),
                TokenSource(self.chunks, seq_len, self.seed, self.what, "validation"))

    def order(self, index: torch.Tensor) -> list[int]:
        """The stream windows that global positions `index` read."""
        perms: dict[int, Permutation] = {}  # a batch spans one epoch, or two
        out = []
        for p in index.tolist():
            epoch = p // self.n
            if epoch not in perms:
                perms[epoch] = Permutation(self.n, f"{self.seed}/order/{epoch}")
            i = perms[epoch](p % self.n)  # the part's i-th window
            if self.part == "train":  # every HOLDOUT-th window of the stream skipped
                i += i // (HOLDOUT - 1)
            elif self.part == "validation":
                i = i * HOLDOUT + HOLDOUT - 1
            out.append(i)
        return out

    def windows(self, index: torch.Tensor) -> torch.Tensor:
        out = torch.empty(index.numel(), self.length, dtype=torch.long)
        for row, window in enumerate(self.order(index.view(-1))):
            start = window * self.length
            c = bisect.bisect_right(self.offsets, start) - 1
            local, filled = start - self.offsets[c], 0
            while filled < self.length:  # a window may continue into the next chunk
                piece = self.chunks[c][local : local + self.length - filled]
                out[row, filled : filled + len(piece)] = piece
                filled, c, local = filled + len(piece), c + 1, 0
        return out


class _HeldOut:
    """An endless source's validation part: windows so far along its order that no training run reaches them."""

    def __init__(self, source, offset: int = 1 << 40):
        self.source, self.offset = source, offset

    def windows(self, index: torch.Tensor) -> torch.Tensor:
        return self.source.windows(index + self.offset)


class HFSource:
    """A Hugging Face dataset streamed document by document; each dp rank reads its own shard (no random access)."""

    streaming = True

    def __init__(self, dataset, text_field: str, tokenizer, seq_len: int):
        self.dataset, self.text_field, self.tokenizer, self.length = dataset, text_field, tokenizer, seq_len + 1

    def open(self, dp_rank: int, dp_size: int, docs: int, offset: int, position: str = "") -> "Packer":
        texts = datasets.HFDocuments(self.dataset, self.text_field, dp_rank, dp_size, position)
        # Without the stream's own position, resuming skips the documents read before, untokenized.
        skipped = texts if texts.position else itertools.islice(texts, docs, None)
        tokens = (self.tokenizer.encode(t, bos=True, eos=True) if t else [] for t in skipped)
        return Packer(tokens, self.length, docs, offset, lambda: texts.position)


class Packer:
    """Cuts windows from a stream of documents' tokens; (docs, offset), the document and token where the next
    window starts, is all it takes to resume exactly. `where`, if given, says where the stream's next document
    starts in the stream's own terms: `position` is then that of document `docs`."""

    def __init__(self, documents, length: int, docs: int = 0, offset: int = 0, where: Callable[[], str] | None = None):
        self.documents, self.length, self.docs, self.offset = documents, length, docs, offset
        self.where = where or (lambda: "")
        self.position = self.where()
        self.read: deque[list[int]] = deque()  # documents docs, docs+1, ... already taken from the stream
        self.starts: deque[str] = deque()  # where each of them started

    def next_window(self) -> torch.Tensor:
        window, i, at = [], 0, self.offset
        while len(window) < self.length:
            if i == len(self.read):
                self.starts.append(self.where())
                self.read.append(next(self.documents))
            if at > len(self.read[i]):  # only a resumed offset can be: this is not the stream the checkpoint read
                raise ConfigError(f"document {self.docs} of the stream has {len(self.read[i])} tokens, but the "
                                  f"checkpoint resumes at token {at} of it: the dataset changed since it was saved")
            piece = self.read[i][at : at + self.length - len(window)]
            window += piece
            at += len(piece)
            if at == len(self.read[i]):
                i, at = i + 1, 0
        for _ in range(i):
            self.read.popleft()
            self.starts.popleft()
        self.docs, self.offset = self.docs + i, at
        self.position = self.starts[0] if self.starts else self.where()
        return torch.tensor(window)


class DataLoader:
    """Yields, per step, this rank's micro-batches of (inputs, labels); stateful for checkpoints."""

    def __init__(self, source, global_batch: int, local_batch: int, dp_rank: int, dp_size: int,
                 shard: Callable[[torch.Tensor], torch.Tensor] | None = None, pin: bool = False,
                 interleave: int = 0):
        """`shard` (context parallelism) cuts inputs and labels down to this rank's part of every sequence. With
        `pin` (a GPU run) batches come in page-locked memory, so their copy to the device need not wait for it.
        `interleave` (training.layout_invariant): the leaf, in sequences (the micro-batch; a pipeline's micro-batch
        under PP). Rank r's leaf t is then the global batch's leaf t * dp_size + r, not the t-th of the rank's
        slice: the leaves the ranks hold at once are adjacent leaves of the canonical tree
        (training/layout_invariant.py)."""
        self.source, self.global_batch, self.local_batch, self.pin = source, global_batch, local_batch, pin
        self.interleave = interleave
        self.shard = shard or (lambda x: x)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        # (first window, windows) of each global batch this rank takes, where replica groups share the batch unevenly
        # (group_share); None: the dp rank's equal slice.
        self.share: tuple[int, int] | None = None
        self.position = 0  # windows of the global order consumed so far
        self.streaming = getattr(source, "streaming", False) is True  # a mixture's is a list: which parts stream
        # Hugging Face streams, opened at the first batch after a possible load_state_dict: the source's (key None)
        # or a mixture's (key: the part), with where each resumes: (docs, offset, position) of a Packer.
        self.streams: dict[int | None, Packer] = {}
        self.saved: dict[int | None, tuple[int, int, str]] = {}
        self.stream_state = (0, 0, "")
        self.sources: list[int] = []  # a mixture's: the source of each window of this rank's last batch

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        per_rank = self.global_batch // self.dp_size
        offset, per_rank = self.share or (self.dp_rank * per_rank, per_rank)
        if self.streaming:
            windows = torch.stack([self._stream(None).next_window() for _ in range(per_rank)])
            self.stream_state = self._states()[None]
        else:
            first = self.position + offset
            index = torch.arange(first, first + per_rank)
            if leaf := self.interleave:
                leaves = per_rank // leaf
                index = (self.position + leaf * (torch.arange(leaves) * self.dp_size + self.dp_rank)
                         ).repeat_interleave(leaf) + torch.arange(leaf).repeat(leaves)
            # A mixture's Hugging Face streams are read in order, each rank its own shard of each.
            if hasattr(self.source, "positions"):
                where = self.source.positions(index.tolist())  # once: the windows, and their sources' losses
                windows = self.source.windows(index, self._take, where)
                self.sources = [i for i, _ in where]
            else:
                windows = self.source.windows(index)
        self.position += self.global_batch
        batches = [(self.shard(w[:, :-1]), self.shard(w[:, 1:])) for w in windows.split(self.local_batch)]
        return [(x.pin_memory(), y.pin_memory()) for x, y in batches] if self.pin else batches

    def _stream(self, part: int | None) -> Packer:
        """This rank's stream of the source (`part` None) or of a mixture's source, opened at its saved place."""
        if part not in self.streams:
            source = self.source if part is None else self.source.parts[part]
            self.streams[part] = source.open(self.dp_rank, self.dp_size, *self.saved.get(part, (0, 0, "")))
        return self.streams[part]

    def _take(self, part: int, n: int) -> torch.Tensor:
        stream = self._stream(part)
        return torch.stack([stream.next_window() for _ in range(n)])

    def _states(self) -> dict[int | None, tuple[int, int, str]]:
        return {**self.saved, **{k: (s.docs, s.offset, s.position) for k, s in self.streams.items()}}

    def state_dict(self) -> dict:
        state = {"position": self.position, "digest": digest(self.source, self.position // self.global_batch)}
        parts = getattr(self.source, "streaming", [])
        if self.streaming:
            docs, offset, position = self.stream_state
            rank = {"docs": docs, "offset": offset, "stream": position}
        elif any(parts):  # a mixture with streams: the state of each, by source name
            states = self._states()
            rank = {self.source.names[i]: dict(zip(("docs", "offset", "stream"), states.get(i, (0, 0, ""))))
                    for i, streamed in enumerate(parts) if streamed}
        else:
            return state
        # One key per rank (DCP saves each), as torchtitan's loader does; dp_size is the same on every rank.
        return {**state, "dp_size": self.dp_size, f"dp_rank_{self.dp_rank}": rank}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        # A checkpoint saved before digests existed has none: `state` keeps the template's, this loader's digest of no
        # steps (which no saved step has: a mixture's lists no quotas, a plain source's is the same at every step).
        if (saved := state.get("digest")) and saved != digest(self.source, 0):
            check_digest(saved, self.source, self.position // self.global_batch)
        if "dp_size" not in state and not self.streaming:
            return
        saved = state.get("dp_size")
        if saved != self.dp_size:
            what = "its data" if self.streaming else "the mixture's Hugging Face sources"
            raise ConfigError(f"the checkpoint streamed {what} on {saved} data-parallel ranks, each its own shard; "
                              f"resuming on {self.dp_size} would replay or skip documents: resume with the same "
                              f"data-parallel degree, or use pre-tokenized data (dataset 'tokens'), which reshards")
        rank = state[f"dp_rank_{self.dp_rank}"]
        # A checkpoint written before streams saved their position has no "stream": the documents are counted.
        if self.streaming:
            self.saved = {None: (int(rank["docs"]), int(rank["offset"]), str(rank.get("stream", "")))}
        else:
            self.saved = {self.source.names.index(n): (int(r["docs"]), int(r["offset"]), str(r["stream"]))
                          for n, r in rank.items()}
        self.streams = {}
        self.stream_state = self.saved.get(None, (0, 0, ""))


def group_share(global_batch: int, local_batch: int, group: int, groups: int, dp_rank: int,
                dp_size: int) -> tuple[int, int]:
    """Rank `dp_rank`'s (first window, windows) of each global batch when `groups` groups of `dp_size` data-parallel
    ranks share it, this one being `group` of them. The unit is a row of micro-batches, one on every rank of a group
    (local_batch * dp_size windows), so that a batch of any whole number of rows splits over any number of groups:
    each takes rows // groups of them, the first rows % groups one more, in the data's order, and its ranks cut its
    rows' windows evenly. Equal shares are then the slices of `groups * dp_size` ranks (next_batch's default)."""
    row = local_batch * dp_size
    rows, more = divmod(global_batch // row, groups)
    first, count = group * rows + min(group, more), rows + (group < more)
    return first * row + dp_rank * count * local_batch, count * local_batch


DATASETS = ("synthetic", "python_stdlib", "text", "jsonl", "tokens", "hf")
FILES = ("text", "jsonl", "tokens")  # the user's files: no validation split of their own


def build_sources(t: Training, v: Validation, tokenizer) -> tuple[Any, Any]:
    """The training source and the validation one (None with validation off).

    An empty validation.dataset follows the training data: to its own validation split where it has one
    (python_stdlib, synthetic, hf), else to every HOLDOUT-th window of the training files, which training then skips.
    Only then: with validation off or reading a source of its own, training reads every window, as it always has.
    """
    if v.enable and v.dataset_path and not v.dataset:
        raise ConfigError("validation.dataset_path is set but validation.dataset is empty: name the dataset too, or "
                          "clear the path to validate on a held-out part of the training data")
    source = build_source(t.dataset, t.dataset_path, t.seq_len, tokenizer, t.seed, text_field=t.dataset_text_field)
    if not v.enable:
        return source, None
    if not v.dataset and t.dataset in FILES:
        train, val = source.hold_out()
        logger.info("validation: every %dth window of the training data, %d windows, never trained on", HOLDOUT,
                    val.n)
        return train, val
    name, path = (v.dataset, v.dataset_path) if v.dataset else (t.dataset, t.dataset_path)
    return source, build_source(name, path, t.seq_len, tokenizer, t.seed, split="validation",
                                text_field=t.dataset_text_field)


def warn_if_validating_on_training_data(t: Training, v: Validation) -> None:
    """A validation source that reads files training reads too measures recall, not generalization: say so, loudly."""
    if not (v.enable and v.dataset in FILES and t.dataset in FILES):
        return
    trained = {f.resolve() for f in datasets.corpus_files(t.dataset, t.dataset_path, "train", "training.dataset_path")}
    both = [f for f in datasets.corpus_files(v.dataset, v.dataset_path, "validation", "validation.dataset_path")
            if f.resolve() in trained]
    if both:
        logger.warning("WARNING: val_loss is measured on training data: validation reads %d file(s) that training "
                       "reads too (%s%s); leave validation.dataset empty to validate on a held-out part of the "
                       "training data", len(both), both[0], ", ..." if len(both) > 1 else "")


def build_source(name: str, path: str, seq_len: int, tokenizer, seed: int | str, split: str = "train",
                 text_field: str = "text", label: str = ""):
    """The source `name` reads from `path`, for split "train" (training.*) or "validation" (validation.*).

    Only python_stdlib (every 50th file is held out), synthetic (a far-away part of its stream) and hf (the split of
    that name) derive a validation split themselves; the others read whatever files `path` names (build_sources
    holds out a part of them). `label` names the config table in errors (a mixture's source), else training.* or
    validation.* does; `seed` may be a string key (a mixture's sources are keyed by name).
    """
    section = label or ("training" if split == "train" else "validation")
    key = f"{section}.{'validation_path' if label and split != 'train' else 'dataset_path'}"
    start = time.perf_counter()
    if name == "synthetic":
        source = SyntheticSource(seq_len, len(tokenizer.ranks), seed)  # ids below the special ones
        return source if split == "train" else _HeldOut(source)
    if name == "hf":
        return HFSource(datasets.load_hf_stream(path, split, text_field, key), text_field, tokenizer, seq_len)
    if name == "tokens":
        files = datasets.corpus_files(name, path, split, key)
        chunks = [datasets.open_shard(f, tokenizer) for f in files]
    elif name in ("python_stdlib", "text", "jsonl"):
        files = datasets.corpus_files(name, path, split, key)
        if name == "python_stdlib":  # the built-in corpus: tokenized once per machine, then memory-mapped
            chunks = [datasets.cached_tokens(files, tokenizer)]
        else:  # the user's files: large corpora belong in pre-tokenized shards (scripts/pretokenize.py)
            kind = "jsonl" if name == "jsonl" else "text"
            if (size := sum(f.stat().st_size for f in files)) > 10 * 2**20:
                logger.warning("%s %s: tokenizing %d files (%.0f MB) at every start", section, name, len(files),
                               size / 2**20)
            docs = (doc for f in files for doc in datasets.read_documents(f, kind, text_field))
            chunks = [datasets.as_tensor(datasets.tokenize_documents(docs, tokenizer))]
        if not len(chunks[0]):
            raise ConfigError(f"{section}.dataset {name}: the {len(files)} files of {path!r} hold no text")
    else:
        raise ConfigError(f"{section}.dataset {name!r} is unknown: use one of {', '.join(DATASETS)}")
    source = TokenSource(chunks, seq_len, seed, f"{section}.dataset {name} ({path or split})")
    elapsed = time.perf_counter() - start
    logger.info("%s %s: %d files, %.2fM tokens, %d windows of %d per epoch (%.1fs)", section, name, len(files),
                source.n_tokens / 1e6, source.n, source.length, elapsed)
    if elapsed > 30:
        logger.warning("every rank tokenizes %s at every start: pre-tokenize it once (scripts/pretokenize.py) and "
                       "train on dataset 'tokens'", path)
    return source


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on the compute device. From pinned memory the copy is queued behind the device's work; from pageable
    memory the host would first wait for all of that work (a sync per micro-batch)."""
    return batch.to(device, non_blocking=batch.is_pinned())
