"""Our tokenizer to and from Hugging Face's format (`tokenizer.json` + `tokenizer_config.json`), as plain JSON.

Why plain JSON: the trainer must not need `transformers` or `tokenizers`; only the tests import them, to prove that
what we write is read back by Hugging Face and encodes to exactly our ids.

Why the merges are derived this way: tiktoken has no merge list. Its BPE first looks the whole pre-token up in the
vocabulary, then repeatedly joins the adjacent pair whose concatenation has the lowest rank (the leftmost on ties).
Hugging Face's BPE joins the listed pair with the lowest merge index (also the leftmost on ties), and with
`ignore_merges` does the same look-up first. When tiktoken joins two parts into token t, no earlier merge crossed
t's span, so the merges inside it were those of tiktoken's BPE run on t's bytes alone: t is always made from one
pair, the last one of that run. Listing that pair for each token, in rank order, gives Hugging Face the same choice
at every step, for any ranks, trained or not. A token the run never reaches (it stops at three or more parts) gets
no merge: tiktoken only makes it by the look-up, and so does `ignore_merges`. (transformers' converter lists every
split of t into two tokens instead: over twice as many merges for Llama 3.)

What cannot match, on purpose or by engine: a special token's name inside text is a special token for Hugging Face
but plain text for `Tokenizer.encode`; `Tokenizer.encode` cuts runs of over MAX_RUN characters, Hugging Face does not;
the regex engines (fancy-regex, Oniguruma) may disagree on characters newer than their Unicode tables.
"""

from __future__ import annotations

import base64
import json
import shutil
import warnings
from itertools import pairwise, zip_longest
from pathlib import Path

from torchtitan_lite.config import ConfigError, JobConfig
from torchtitan_lite.data.tokenizer import (
    BOS,
    EOS,
    LLAMA3_N_RANKS,
    LLAMA3_PAT,
    LLAMA3_SPECIALS,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for chars from U+0100 up, so
    every token is a printable string that JSON and the merge list (space separated in old files) carry safely."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
# Hugging Face's "no limit" (transformers' VERY_LARGE_INTEGER), written when the caller knows no context length.
NO_MAX_LENGTH = int(1e30)


def _hf(token: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in token)


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
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


def _derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per reachable token, in rank order (see the module docstring for why this reproduces tiktoken)."""
    merges = []
    for token in sorted(ranks, key=ranks.__getitem__):
        if len(token) > 1 and (pair := _last_merge(token, ranks)) is not None:
            merges.append(pair)
    return merges


def _pre_tokenizer() -> dict:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PAT}, "behavior": "Isolated", "invert": False},
            # The regex has already split the text: ByteLevel only maps bytes to GPT-2's alphabet.
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


def _added_token(name: str) -> dict:
    # normalized False: matched in the text as written; special: dropped by decode(skip_special_tokens=True).
    return {
        "content": name,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


def _tokenizer_json(tokenizer: Tokenizer) -> dict:
    ranks = tokenizer.ranks
    bos = {"id": BOS, "ids": [tokenizer.bos_id], "tokens": [BOS]}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, **_added_token(name)} for name, i in tokenizer.special_tokens.items()],
        "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(),
        # Like our encode(bos=True, eos=False), which is how training documents start.
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": BOS, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": BOS, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {BOS: bos},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,  # tiktoken's whole-word look-up
            "vocab": {_hf(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])},
            "merges": [[_hf(a), _hf(b)] for a, b in _derive_merges(ranks)],
        },
    }


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: str | Path, *, model_max_length: int | None = None) -> None:
    """Writes `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` into out_dir, for
    `transformers.AutoTokenizer.from_pretrained(out_dir)`; `tokenizer(text)["input_ids"]` then equals
    `tokenizer.encode(text, bos=True, eos=False)`. model_max_length: the model's context, if known."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # special_tokens_map.json's entries have no "special" field: every one of them is.
    special = {
        key: {k: v for k, v in _added_token(name).items() if k != "special"}
        for key, name in [("bos_token", BOS), ("eos_token", EOS)]
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # the generic class: reads tokenizer.json as it is
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        # True (transformers 4's default) edits decoded text (" ," -> ","): decode would not give back the text.
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length or NO_MAX_LENGTH,
        "added_tokens_decoder": {str(i): _added_token(name) for name, i in tokenizer.special_tokens.items()},
    }
    files = {
        "tokenizer.json": _tokenizer_json(tokenizer),
        "tokenizer_config.json": config,
        "special_tokens_map.json": special,
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def load_hf_tokenizer(hf_dir: str | Path, out_path: str | Path) -> Tokenizer:
    """Writes the tokenizer of a Hugging Face folder as a tiktoken file at out_path and returns it loaded.

    Meta's `original/tokenizer.model` is preferred when present: it already is the tiktoken file that
    `Tokenizer.from_file` reads (with Llama 3's special tokens, also for 3.1's file, whose tokenizer.json renames
    some reserved ones). Otherwise `tokenizer.json` must be a byte-level BPE that our Tokenizer reproduces exactly:
    Llama 3's pre-tokenizer, ranks 0..n-1, then the special tokens that `Tokenizer.from_file` numbers after them.
    Anything else is a ValueError naming the first difference."""
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    meta_file, hf_file = hf_dir / "original" / "tokenizer.model", hf_dir / "tokenizer.json"
    if meta_file.is_file():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(meta_file, out_path)
    elif hf_file.is_file():
        ranks = _ranks_from_tokenizer_json(hf_file)
        lines = [b"%s %d\n" % (base64.b64encode(t), r) for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_bytes(b"".join(lines))
    else:
        raise FileNotFoundError(f"{hf_dir} has neither tokenizer.json nor original/tokenizer.model")
    return build_tokenizer(str(out_path))


def folder_tokenizer(hf_dir: str | Path) -> Tokenizer | None:
    """The tokenizer of a Hugging Face folder, by load_hf_tokenizer's rules but read in memory; None when the folder
    has none."""
    meta_file, hf_file = Path(hf_dir) / "original" / "tokenizer.model", Path(hf_dir) / "tokenizer.json"
    if meta_file.is_file():
        return Tokenizer.from_file(meta_file)
    if not hf_file.is_file():
        return None
    ranks = _ranks_from_tokenizer_json(hf_file)
    return Tokenizer(Path(hf_dir).name, ranks, LLAMA3_SPECIALS if len(ranks) == LLAMA3_N_RANKS else [BOS, EOS])


def run_tokenizer(cfg: JobConfig) -> Tokenizer:
    """The tokenizer of the run `cfg` configures: model.tokenizer_path's; for a run that starts from a Hugging Face
    folder (checkpoint.initial_load_in_hf) and names none, the folder's own (byte level if it has none). Decided by
    the config alone, so a resume, generate.py and the export all get the one the run started with."""
    ck = cfg.checkpoint
    if cfg.model.tokenizer_path or not (ck.initial_load_in_hf and ck.initial_load_path):
        return load_tokenizer(cfg.model.tokenizer_path)
    try:
        return folder_tokenizer(ck.initial_load_path) or load_tokenizer("")
    except (OSError, ValueError) as e:
        raise ConfigError(f"the tokenizer of checkpoint.initial_load_path: {e}: set model.tokenizer_path to a "
                          "tiktoken file of the same ids") from None


def _ranks_from_tokenizer_json(path: Path) -> dict[bytes, int]:
    def refuse(what: str) -> ValueError:
        return ValueError(f"{path}: cannot convert to our tiktoken tokenizer: {what}")

    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise refuse(f"not JSON ({e})") from None
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise refuse(f"its model is {model.get('type')}, not a byte-level BPE")
    if spec.get("normalizer"):
        raise refuse(f"it normalizes text first ({spec['normalizer'].get('type')}), ours does not")
    if problem := _pre_tokenizer_problem(spec.get("pre_tokenizer")):
        raise refuse(problem)
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if model.get(key):
            raise refuse(f"its BPE has {key}={model[key]!r}, tiktoken has no such option")

    added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
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

    # The same rule as Tokenizer.from_file, so that the tiktoken file we write gets these specials back.
    expected = LLAMA3_SPECIALS if n == LLAMA3_N_RANKS else [BOS, EOS]
    found = sorted((i, name) for name, i in added.items())
    for k, (got, want) in enumerate(zip_longest(found, [(n + k, name) for k, name in enumerate(expected)])):
        if got != want:
            raise refuse(f"special token #{k} is {_named(got)}; after {n} ranks, ours is {_named(want)}")

    if problem := _merges_problem(model, ranks, vocab):
        warnings.warn(f"{path}: some texts may encode differently than in Hugging Face: {problem}", stacklevel=3)
    return ranks


def _named(token: tuple[int, str] | None) -> str:
    return f"{token[1]!r} with id {token[0]}" if token else "none"


def _pre_tokenizer_problem(pre: dict | None) -> str | None:
    steps = ((pre or {}).get("pretokenizers") or []) if (pre or {}).get("type") == "Sequence" else [pre]
    kinds = [(s or {}).get("type") for s in steps]
    if kinds != ["Split", "ByteLevel"]:
        return f"its pre-tokenizer is {kinds}, ours is ['Split' by Llama 3's regex, 'ByteLevel']"
    split, byte_level = steps
    pattern = (split.get("pattern") or {}).get("Regex")
    if pattern != LLAMA3_PAT:
        return f"its pre-tokenizer regex {str(pattern)[:80]!r}... is not Llama 3's"
    # Our regex matches every character, so keeping the matches and dropping the rest is the same split.
    if (split.get("behavior"), bool(split.get("invert"))) not in [("Isolated", False), ("Removed", True)]:
        return f"its Split keeps {split.get('behavior')} (invert={split.get('invert')}), tiktoken isolates matches"
    if byte_level.get("add_prefix_space") or byte_level.get("use_regex", True):
        return "its ByteLevel step adds a prefix space or splits again by GPT-2's regex"
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
        if len(token) > 1 and (pair := _last_merge(token, ranks)) is not None:
            if (_hf(pair[0]), _hf(pair[1])) not in merges:
                return f"it has no merge {_hf(pair[0])!r} + {_hf(pair[1])!r} for id {rank}, tiktoken's way to it"
        elif len(token) > 1 and not model.get("ignore_merges"):
            return f"id {rank} ({_hf(token)!r}) is reached by whole-word look-up only, and ignore_merges is off"
    return None
