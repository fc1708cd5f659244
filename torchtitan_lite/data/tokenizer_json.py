"""A Hugging Face tokenizer.json as tiktoken can reproduce it: its ranks, regex, normalizer and added tokens, read as
plain JSON (the trainer must not need `tokenizers`), or a one-line ValueError naming what tiktoken cannot do.

What it accepts: a byte-level BPE (GPT-2's alphabet) split by one regex that matches every character, so that
keeping the matches (tiktoken) and isolating them (Hugging Face's Split) cut alike, checked on a probe of every
Unicode category; no normalizer or NFC; added tokens after the ranks, with the ids `tokenizers` gives them (it reads
none: consecutive after the vocab, in the file's order). That is Llama 3's and the Qwen2/Qwen3 family's
tokenizer.json. The merges must be the ones tiktoken's BPE implies (hf_tokenizer.py says why that is when each
token's last merge is listed in id order); where they are not, a warning, since the ranks are the ids the embedding
rows follow all the same.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from itertools import pairwise, zip_longest
from pathlib import Path

import tiktoken

from torchtitan_lite.data.tokenizer import BOS, EOS, LLAMA3_N_RANKS, LLAMA3_PAT, LLAMA3_SPECIALS


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for chars from U+0100 up, so
    every token is a printable string that JSON and the merge list (space separated in old files) carry safely."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def hf_chars(token: bytes) -> str:
    """A token as tokenizer.json writes it, in GPT-2's alphabet."""
    return "".join(BYTE_TO_CHAR[b] for b in token)


def last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two parts tiktoken's BPE joins into `token` when run on its bytes alone, None if it never gets there."""
    get, never = ranks.get, len(ranks)
    parts = list(map(int.to_bytes, token))
    pair_ranks = [get(a + b, never) for a, b in pairwise(parts)]  # pair_ranks[i]: parts i and i + 1 joined
    while len(parts) > 2:
        best = min(pair_ranks)
        if best == never:
            return None
        i = pair_ranks.index(best)  # the leftmost, as tiktoken
        parts[i] = merged = parts[i] + parts.pop(i + 1)
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = get(parts[i - 1] + merged, never)
        if i < len(parts) - 1:
            pair_ranks[i] = get(merged + parts[i + 1], never)
    return parts[0], parts[1]


@dataclass(frozen=True)
class TokenizerJson:
    """What our Tokenizer needs from a tokenizer.json: ranks, added tokens {name: id}, those that are tokens in
    text too (not special), the pre-tokenizer's regex, NFC or no normalizer."""
    ranks: dict[bytes, int]
    added: dict[str, int]
    in_text: frozenset[str]
    pattern: str
    nfc: bool


def refusal(path: Path):
    """How a reader of `path` refuses: ValueError(what), in one line."""
    return lambda what: ValueError(f"{path}: cannot convert to our tiktoken tokenizer: {what}")


def read_tokenizer_json(path: Path) -> TokenizerJson:
    """The file's tokenizer if tiktoken reproduces it id for id, else a ValueError naming the first obstacle."""
    refuse = refusal(path)
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise refuse(f"not JSON ({e})") from None
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise refuse(f"its model is {model.get('type')}, not a byte-level BPE")
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer not in (None, "NFC"):
        raise refuse(f"it normalizes text first ({normalizer}), ours only by NFC")
    if problem := _pre_tokenizer_problem(spec.get("pre_tokenizer")):
        raise refuse(problem)
    pattern = spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    if problem := _pattern_problem(pattern):
        raise refuse(problem)
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise refuse(f"its BPE has {key}={model[key]!r}, tiktoken has no such option")

    tokens = spec.get("added_tokens") or []
    added = {t["content"]: t["id"] for t in tokens}
    in_text = frozenset(t["content"] for t in tokens if not t.get("special"))
    for t in tokens:
        # A special token is plain text to us; one that text holds as a token must match as its name is written.
        flags = [k for k in ("lstrip", "rstrip", "single_word") if t.get(k)] + ["normalized"] * bool(
            normalizer and t.get("normalized"))
        if t["content"] in in_text and flags:
            raise refuse(f"its added token {t['content']!r} matches with {flags}, ours only as written")
    vocab: dict[str, int] = model.get("vocab") or {}
    ranks: dict[bytes, int] = {}
    for text, i in vocab.items():
        if text in added:
            if added[text] != i:
                raise refuse(f"{text!r} is id {i} in the vocab but {added[text]} as an added token")
            continue
        if any(c not in CHAR_TO_BYTE for c in text):
            raise refuse(f"vocab token {text!r} (id {i}) is not in GPT-2's byte-level alphabet")
        ranks[bytes(CHAR_TO_BYTE[c] for c in text)] = i
    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
        ids = set(ranks.values())
        gap = next((f"no token has id {i}" for i in range(n) if i not in ids), "two tokens share an id")
        raise refuse(f"its vocab ids (special tokens aside) are not 0..{n - 1}, each once: {gap}")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise refuse(f"{len(missing)} of the 256 single bytes have no token, e.g. byte {missing[0]}")
    if problem := _added_ids_problem(tokens, vocab):
        raise refuse(problem)

    if problem := _merges_problem(model, ranks, vocab):
        warnings.warn(f"{path}: some texts may encode differently than in Hugging Face: {problem}", stacklevel=4)
    return TokenizerJson(ranks, added, in_text, pattern, normalizer == "NFC")


def _added_ids_problem(tokens: list[dict], vocab: dict[str, int]) -> str | None:
    """Where the file's ids of added tokens are not the ones Hugging Face's `tokenizers` gives them, or None. It reads
    no id of a token outside the vocab: it numbers each the next free id after the vocab, in the file's order (a file
    with gaps or another order loads renumbered, with a warning), so such a file's ids mean two things."""
    given: dict[str, int] = {}
    for t in tokens:
        if t["content"] not in given:
            top = max(given.values(), default=-1)
            given[t["content"]] = vocab.get(t["content"], top + 1 if top >= len(vocab) else len(vocab))
        if t["id"] != given[t["content"]]:
            return (f"its added token {t['content']!r} has id {t['id']}, but Hugging Face's tokenizers numbers it "
                    f"{given[t['content']]} (the next free id after the vocab, in the file's order)")
    return None


def tiktoken_file_specials(ranks: dict[bytes, int]) -> list[str]:
    """The special tokens Tokenizer.from_file numbers after a tiktoken file's ranks."""
    return LLAMA3_SPECIALS if len(ranks) == LLAMA3_N_RANKS else [BOS, EOS]


def tiktoken_file_problem(read: TokenizerJson) -> str | None:
    """Why a tiktoken file of these ranks would not load as this tokenizer (Tokenizer.from_file's regex, no
    normalizer, its special tokens), or None."""
    if read.pattern != LLAMA3_PAT:
        return f"its pre-tokenizer regex {read.pattern[:80]!r}... is not Llama 3's, which a tiktoken file implies"
    if read.nfc:
        return "it normalizes text first (NFC), which a tiktoken file cannot say"
    n, found = len(read.ranks), sorted((i, name) for name, i in read.added.items())
    expected = [(n + k, name) for k, name in enumerate(tiktoken_file_specials(read.ranks))]
    for k, (got, want) in enumerate(zip_longest(found, expected)):
        if got != want:
            return f"special token #{k} is {_named(got)}; after {n} ranks, ours is {_named(want)}"
    return None


def ranks_for_tiktoken_file(path: Path) -> dict[bytes, int]:
    """The ranks of a tokenizer.json whose tokenizer a tiktoken file of them gives back, else a ValueError."""
    read = read_tokenizer_json(path)
    if problem := tiktoken_file_problem(read):
        raise refusal(path)(problem)
    return read.ranks


def _named(token: tuple[int, str] | None) -> str:
    return f"{token[1]!r} with id {token[0]}" if token else "none"


def _pre_tokenizer_problem(pre: dict | None) -> str | None:
    steps = ((pre or {}).get("pretokenizers") or []) if (pre or {}).get("type") == "Sequence" else [pre]
    kinds = [(s or {}).get("type") for s in steps]
    if kinds != ["Split", "ByteLevel"]:
        return f"its pre-tokenizer is {kinds}, ours is ['Split' by a regex, 'ByteLevel']"
    split, byte_level = steps
    if not isinstance((split.get("pattern") or {}).get("Regex"), str):
        return f"its Split is by {split.get('pattern')}, not a regex"
    # A regex that matches every character (_pattern_problem) splits alike keeping the matches or dropping the rest.
    if (split.get("behavior"), bool(split.get("invert"))) not in [("Isolated", False), ("Removed", True)]:
        return f"its Split keeps {split.get('behavior')} (invert={split.get('invert')}), tiktoken isolates matches"
    if byte_level.get("add_prefix_space") or byte_level.get("use_regex", True):
        return "its ByteLevel step adds a prefix space or splits again by GPT-2's regex"
    return None


# One character of each Unicode category, and the whitespace the regexes single out.
_PROBE_CHARS = ("aAǅʰª中\u0301\u0903\u20dd0Ⅻ½_-()«»!+$^©'s \u00a0\u2028\u2029\x00\t\n\r\x0b\x0c\x85\u200d\ue000"
                "\u0378🙂")
_PROBE = "".join(a + b for a in _PROBE_CHARS for b in _PROBE_CHARS) + "  \n\n x  "


def _pattern_problem(pattern: str) -> str | None:
    """Why tiktoken cannot split by this regex as Hugging Face does, or None. tiktoken keeps the matches only, so the
    regex must match every character, as Llama 3's and Qwen's do: checked on each probe character after each."""
    try:
        probe = tiktoken.Encoding("probe", pat_str=pattern, mergeable_ranks={bytes([i]): i for i in range(256)},
                                  special_tokens={})
    except ValueError as e:
        return f"tiktoken's regex engine refuses its pre-tokenizer regex {pattern[:80]!r}...: {e}"
    kept = probe.decode(probe.encode_ordinary(_PROBE))
    if kept != _PROBE:
        lost = next((a for a, b in zip(_PROBE, kept) if a != b), _PROBE[len(kept):][:1])
        return f"its pre-tokenizer regex {pattern[:80]!r}... matches no text at {lost!r}, which tiktoken would drop"
    return None


def _merges_problem(model: dict, ranks: dict[bytes, int], vocab: dict[str, int]) -> str | None:
    """Why Hugging Face's BPE may differ from tiktoken on these ranks (the ranks are the ids: the embedding rows
    follow them), or None. It matches when its merges are in id order and hold each token's last merge (every-split
    lists such as transformers' also do)."""
    listed = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    merges, last_id = set(listed), -1
    for a, b in listed:
        made = vocab.get(a + b)
        if made is None:
            return f"merge {a!r} + {b!r} makes no token"
        if made < last_id:
            return f"merge {a!r} + {b!r} makes id {made} after id {last_id}, so it is applied later than its rank"
        last_id = made
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1 and (pair := last_merge(token, ranks)) is not None:
            a, b = hf_chars(pair[0]), hf_chars(pair[1])
            if (a, b) not in merges:
                return f"it has no merge {a!r} + {b!r} for id {rank}, tiktoken's way to it"
        elif len(token) > 1 and not model.get("ignore_merges"):
            return f"id {rank} ({hf_chars(token)!r}) is reached by whole-word look-up only, and ignore_merges is off"
    return None
