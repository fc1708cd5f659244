"""The tokenizer: a tiktoken BPE plus BOS/EOS, loaded from a tiktoken-format file or built over raw bytes.

Three vocabularies, all split into pre-tokens by Llama 3's regex:
- byte level (`tokenizer_path = ""`): the 256 bytes + BOS/EOS, 258 ids; needs no file, good for tests.
- the project's own BPE (`torchtitan_lite/assets/stdlib_bpe_2k.tiktoken`, from `scripts/train_tokenizer.py`):
  its ranks, then BOS/EOS.
- Llama 3's `original/tokenizer.model` (`scripts/download_tokenizer.py`): 128000 ranks + Meta's 256 special tokens.
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import cached_property
from pathlib import Path

import tiktoken

from torchtitan_lite.config import ConfigError

# Llama 3's pre-tokenizer: contractions, words with one leading non-letter, numbers of at most 3 digits,
# punctuation runs, newlines, and whitespace (the last space before a word stays with the word).
LLAMA3_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# The project's own BPE: `train_tokenizer.py --input stdlib` run on CPython 3.11.7 (other versions' stdlib differ).
STDLIB_BPE = Path(__file__).parents[1] / "assets" / "stdlib_bpe_2k.tiktoken"

# Llama 3's tokenizer.model is recognised by its size alone: it is the only file we load with exactly this many
# ranks, and its special tokens are not in the file, so they must be re-created exactly as Meta's tokenizer does.
LLAMA3_N_RANKS = 128_000
LLAMA3_SPECIALS = [
    BOS,
    EOS,
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",  # end of turn
] + [f"<|reserved_special_token_{i}|>" for i in range(5, 256 - 5)]

# tiktoken's regex gets slow (and its BPE quadratic) on huge pre-tokens, so text is cut before encoding, as Meta's
# llama3 tokenizer does: pieces of at most MAX_CHARS, and no run of whitespace or non-whitespace above MAX_RUN.
MAX_CHARS = 400_000
MAX_RUN = 25_000
# A run start: a lookbehind anchors the match, so scanning is linear even inside long runs just under the limit.
_LONG_RUN = re.compile(r"(?<!\s)\s{%d,}|(?<!\S)\S{%d,}" % (MAX_RUN + 1, MAX_RUN + 1))


def read_tiktoken_file(path: str | Path) -> dict[bytes, int]:
    """Reads `base64(token) rank` lines; tiktoken.load.load_tiktoken_bpe would also fetch URLs and cache them."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path.absolute()} not found (set model.tokenizer_path to a tiktoken "
                                "BPE file, or '' for bytes)")

    def bad(what: str) -> ValueError:
        return ValueError(f"tokenizer file {path} is not in tiktoken format ({what})")

    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise bad(f"line {n}: expected 'base64_token rank', got {line[:60]!r}")
        try:
            token = base64.b64decode(fields[0], validate=True)
        except ValueError:
            raise bad(f"line {n}: bad base64 {fields[0][:60]!r}") from None
        if not fields[1].isdigit():
            raise bad(f"line {n}: rank {fields[1][:60]!r} is not a non-negative integer")
        if token in ranks:
            raise bad(f"line {n}: token {token!r} appears twice")
        ranks[token] = int(fields[1])
    if not ranks:
        raise bad("no tokens: the file is empty")
    # Special tokens are numbered after the ranks, and tiktoken fails on a byte it has no token for.
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise bad(f"ranks are not 0..{len(ranks) - 1}, each once")
    missing = [i for i in range(256) if bytes([i]) not in ranks]
    if missing:
        raise bad(f"{len(missing)} of the 256 single bytes have no token, e.g. byte {missing[0]}")
    return ranks


def _pieces(text: str):
    """Yields consecutive pieces of `text` that tiktoken encodes safely; for normal text the tokens don't change."""
    start = 0
    while len(text) - start > MAX_CHARS:
        # Cutting just after a newline that starts a non-blank line is exact: no Llama 3 pre-token crosses it.
        end = text.rfind("\n", start, start + MAX_CHARS - 1)
        while end >= start and text[end + 1].isspace():
            end = text.rfind("\n", start, end)
        end = end + 1 if end >= start else start + MAX_CHARS  # one huge line: cut anywhere, as Meta does
        yield from _split_long_runs(text[start:end])
        start = end
    yield from _split_long_runs(text[start:])


def _split_long_runs(text: str):
    if len(text) <= MAX_RUN:  # the common case: no run can be too long
        yield text
        return
    start = 0
    for run in _LONG_RUN.finditer(text):
        for cut in range(run.start() + MAX_RUN, run.end(), MAX_RUN):
            yield text[start:cut]
            start = cut
    yield text[start:]


class Tokenizer:
    """tiktoken BPE with BOS/EOS; ids are in [0, n_words)."""

    def __init__(self, name: str, ranks: dict[bytes, int], specials: list[str]):
        n = len(ranks)
        self.special_tokens = {s: n + i for i, s in enumerate(specials)}
        self.model = tiktoken.Encoding(
            name=name,
            pat_str=LLAMA3_PAT,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
            explicit_n_vocab=n + len(specials),
        )
        self.n_words: int = n + len(specials)
        self.bos_id: int = self.special_tokens[BOS]
        self.eos_id: int = self.special_tokens[EOS]
        self.ranks = ranks  # token bytes -> id, below the special tokens

    @classmethod
    def byte_level(cls) -> "Tokenizer":
        return cls("byte_level", {bytes([i]): i for i in range(256)}, [BOS, EOS])

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        ranks = read_tiktoken_file(path)
        specials = LLAMA3_SPECIALS if len(ranks) == LLAMA3_N_RANKS else [BOS, EOS]
        return cls(Path(path).stem, ranks, specials)

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        ids = [self.bos_id] if bos else []
        for piece in _pieces(text):
            # Special-token names in training text are ordinary text: never raise on them, never emit their ids.
            ids += self.model.encode(piece, allowed_special=set(), disallowed_special=())
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        # "replace": a slice of ids may end in the middle of a multi-byte character.
        return self.model.decode(list(ids), errors="replace")

    @cached_property
    def identity(self) -> str:
        """A fingerprint of what the ids mean (ranks, specials, split pattern), e.g. to match pre-tokenized shards."""
        h = hashlib.sha256(LLAMA3_PAT.encode())
        for token, rank in sorted(self.ranks.items(), key=lambda kv: kv[1]):
            h.update(b"%d %s\n" % (rank, base64.b64encode(token)))
        for name, i in self.special_tokens.items():
            h.update(b"%d %s\n" % (i, name.encode()))
        return h.hexdigest()[:16]


def build_tokenizer(tokenizer_path: str) -> Tokenizer:
    return Tokenizer.from_file(tokenizer_path) if tokenizer_path else Tokenizer.byte_level()


def load_tokenizer(tokenizer_path: str) -> Tokenizer:
    """build_tokenizer for a run's config: a missing or malformed file is a ConfigError naming the option."""
    try:
        return build_tokenizer(tokenizer_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.tokenizer_path: {e}") from None
