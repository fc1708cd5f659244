"""The tokenizer: a tiktoken BPE plus BOS/EOS, loaded from a tiktoken-format file or built over raw bytes.

Three vocabularies from tiktoken files (or none), all split into pre-tokens by Llama 3's regex:
- byte level (`tokenizer_path = ""`): the 256 bytes + BOS/EOS, 258 ids; needs no file, good for tests.
- the project's own BPE (`torchtitan_lite/assets/stdlib_bpe_2k.tiktoken`, from `scripts/train_tokenizer.py`):
  its ranks, then BOS/EOS.
- Llama 3's `original/tokenizer.model` (`scripts/download_tokenizer.py`): 128000 ranks + Meta's 256 special tokens.
A Hugging Face folder's tokenizer.json (data/tokenizer_json.py) may bring what a tiktoken file cannot say: its own
regex, NFC normalization, its own special tokens and ids, no BOS (Qwen's), and added tokens that text holds as tokens
(Qwen3's `<think>`). Each is a constructor argument whose default is the tiktoken files' way.
"""

from __future__ import annotations

import base64
import hashlib
import re
import unicodedata
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
        # Cutting just after a newline that starts a non-blank line is exact: no Llama 3 (or Qwen) pre-token crosses it.
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
    """tiktoken BPE with special tokens; ids are in [0, n_words).

    specials: names numbered right after the ranks, or {name: id} with ids above them (gaps allowed). bos None: the
    vocabulary has none, and a document is its text + EOS, as Qwen pretrains (the EOS before it separates it).
    in_text: added tokens that are tokens in text too (Hugging Face's non-special ones): encode gives their ids."""

    def __init__(self, name: str, ranks: dict[bytes, int], specials: list[str] | dict[str, int], *,
                 pattern: str = LLAMA3_PAT, nfc: bool = False, bos: str | None = BOS, eos: str = EOS,
                 in_text: frozenset[str] = frozenset()):
        n = len(ranks)
        if isinstance(specials, list):
            specials = {s: n + i for i, s in enumerate(specials)}
        ids = sorted(specials.values())
        if (ids and ids[0] < n) or len(set(ids)) < len(ids):
            raise ValueError(f"special token ids {ids[:3]}... are not distinct ids above the {n} ranks")
        for token in (bos, eos, *in_text):
            if token is not None and token not in specials:
                raise ValueError(f"{token!r} is not one of the special tokens {list(specials)[:5]}...")
        self.special_tokens = dict(sorted(specials.items(), key=lambda kv: kv[1]))
        self.n_words: int = ids[-1] + 1 if ids else n
        self.model = tiktoken.Encoding(
            name=name,
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
            # The check only holds without gaps; with them, n_words still counts every id below the last.
            explicit_n_vocab=self.n_words if self.n_words == n + len(ids) else None,
        )
        self.bos_id: int | None = None if bos is None else self.special_tokens[bos]
        self.eos_id: int = self.special_tokens[eos]
        self.ranks = ranks  # token bytes -> id, below the special tokens
        self.pattern, self.nfc, self.bos, self.eos, self.in_text = pattern, nfc, bos, eos, frozenset(in_text)
        # Hugging Face finds added tokens leftmost-longest: longest first in the alternation does the same.
        longest_first = sorted(self.in_text, key=lambda s: (-len(s), s))
        self._in_text = re.compile("|".join(map(re.escape, longest_first))) if in_text else None

    @classmethod
    def byte_level(cls) -> "Tokenizer":
        return cls("byte_level", {bytes([i]): i for i in range(256)}, [BOS, EOS])

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        ranks = read_tiktoken_file(path)
        specials = LLAMA3_SPECIALS if len(ranks) == LLAMA3_N_RANKS else [BOS, EOS]
        return cls(Path(path).stem, ranks, specials)

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        ids = [self.bos_id] if bos and self.bos_id is not None else []
        start = 0
        for token in self._in_text.finditer(text) if self._in_text else ():
            ids += self._encode_plain(text[start:token.start()])
            ids.append(self.special_tokens[token.group()])
            start = token.end()
        ids += self._encode_plain(text[start:])
        if eos:
            ids.append(self.eos_id)
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        # After the added tokens are cut out, as Hugging Face normalizes: NFC cannot join text across one of them.
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        ids = []
        for piece in _pieces(text):
            # Special-token names in training text are ordinary text: never raise on them, never emit their ids.
            ids += self.model.encode(piece, allowed_special=set(), disallowed_special=())
        return ids

    def decode(self, ids: list[int]) -> str:
        # "replace": a slice of ids may end in the middle of a multi-byte character.
        try:
            return self.model.decode(list(ids), errors="replace")
        except KeyError:  # an id of no token (a gap between special ids, a padded embedding's row): nothing, as HF
            known = set(self.special_tokens.values())
            return self.model.decode([i for i in ids if 0 <= i < len(self.ranks) or i in known], errors="replace")

    @cached_property
    def identity(self) -> str:
        """A fingerprint of what the ids mean (ranks, specials, split pattern), e.g. to match pre-tokenized shards."""
        h = hashlib.sha256(self.pattern.encode())
        for token, rank in sorted(self.ranks.items(), key=lambda kv: kv[1]):
            h.update(b"%d %s\n" % (rank, base64.b64encode(token)))
        for name, i in self.special_tokens.items():
            h.update(b"%d %s\n" % (i, name.encode()))
        # Only what a tiktoken file cannot say is added, so the identities its shards recorded stay valid.
        if self.nfc or self.in_text or (self.bos, self.eos) != (BOS, EOS):
            h.update(f"nfc {self.nfc} bos {self.bos} eos {self.eos} in text {sorted(self.in_text)}\n".encode())
        return h.hexdigest()[:16]


def build_tokenizer(tokenizer_path: str) -> Tokenizer:
    return Tokenizer.from_file(tokenizer_path) if tokenizer_path else Tokenizer.byte_level()


def load_tokenizer(tokenizer_path: str) -> Tokenizer:
    """build_tokenizer for a run's config: a missing or malformed file is a ConfigError naming the option."""
    try:
        return build_tokenizer(tokenizer_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.tokenizer_path: {e}") from None
