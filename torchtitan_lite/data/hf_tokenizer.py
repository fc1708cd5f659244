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

Reading (tokenizer_json.py says what tiktoken reproduces): a tiktoken file cannot say a regex, a normalizer or
special tokens of its own, so load_hf_tokenizer writes one only for the tokenizer.json it stands for; a run that
starts from a folder takes any reproducible one in memory (folder_tokenizer: Qwen's too), and its model's
vocabulary is config.json's where that pads the embedding (run_vocab_size).

What cannot match, on purpose or by engine: a special token's name inside text is a special token for Hugging Face
but plain text for `Tokenizer.encode` (a non-special added token, such as Qwen3's `<think>`, is a token for both);
`Tokenizer.encode` cuts runs of over MAX_RUN characters, Hugging Face does not; the regex engines (fancy-regex,
Oniguruma) may disagree on characters newer than their Unicode tables.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

from torchtitan_lite.config import ConfigError, JobConfig
from torchtitan_lite.data.tokenizer import BOS, EOS, Tokenizer, build_tokenizer, load_tokenizer
from torchtitan_lite.data.tokenizer_json import (
    hf_chars,
    last_merge,
    ranks_for_tiktoken_file,
    read_tokenizer_json,
    tiktoken_file_problem,
    tiktoken_file_specials,
)

# Hugging Face's "no limit" (transformers' VERY_LARGE_INTEGER), written when the caller knows no context length.
NO_MAX_LENGTH = int(1e30)


def _derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per reachable token, in rank order (see the module docstring for why this reproduces tiktoken)."""
    merges = []
    for token in sorted(ranks, key=ranks.__getitem__):
        if len(token) > 1 and (pair := last_merge(token, ranks)) is not None:
            merges.append(pair)
    return merges


def _pre_tokenizer(pattern: str) -> dict:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            # The regex has already split the text: ByteLevel only maps bytes to GPT-2's alphabet.
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


def _added_token(name: str, special: bool = True) -> dict:
    # normalized False: matched in the text as written; special: dropped by decode(skip_special_tokens=True), and
    # not a token in text under split_special_tokens (a non-special one always is: Tokenizer's in_text).
    return {
        "content": name,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def _added_tokens(tokenizer: Tokenizer) -> dict[int, dict]:
    return {i: _added_token(name, name not in tokenizer.in_text) for name, i in tokenizer.special_tokens.items()}


def _bos_template(tokenizer: Tokenizer) -> dict | None:
    """Like our encode(bos=True, eos=False), which is how training documents start; None without a BOS."""
    if tokenizer.bos is None:
        return None
    bos = {"SpecialToken": {"id": tokenizer.bos, "type_id": 0}}
    return {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": tokenizer.bos, "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {tokenizer.bos: {"id": tokenizer.bos, "ids": [tokenizer.bos_id], "tokens": [tokenizer.bos]}},
    }


def _tokenizer_json(tokenizer: Tokenizer) -> dict:
    ranks = tokenizer.ranks
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, **token} for i, token in _added_tokens(tokenizer).items()],
        "normalizer": {"type": "NFC"} if tokenizer.nfc else None,
        "pre_tokenizer": _pre_tokenizer(tokenizer.pattern),
        "post_processor": _bos_template(tokenizer),
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
            "vocab": {hf_chars(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])},
            "merges": [[hf_chars(a), hf_chars(b)] for a, b in _derive_merges(ranks)],
        },
    }


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: str | Path, *, model_max_length: int | None = None) -> None:
    """Writes `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` into out_dir, for
    `transformers.AutoTokenizer.from_pretrained(out_dir)`; `tokenizer(text)["input_ids"]` then equals
    `tokenizer.encode(text, bos=True, eos=False)`. model_max_length: the model's context, if known."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # special_tokens_map.json's entries have no "special" field: every one of them is.
    named = [("bos_token", tokenizer.bos), ("eos_token", tokenizer.eos)]
    special = {key: {k: v for k, v in _added_token(name).items() if k != "special"} for key, name in named if name}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # the generic class: reads tokenizer.json as it is
        "bos_token": tokenizer.bos,
        "eos_token": tokenizer.eos,
        "add_bos_token": tokenizer.bos is not None,
        "add_eos_token": False,
        # True (transformers 4's default) edits decoded text (" ," -> ","): decode would not give back the text.
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length or NO_MAX_LENGTH,
        "added_tokens_decoder": {str(i): token for i, token in _added_tokens(tokenizer).items()},
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
    some reserved ones). Otherwise `tokenizer.json` must be a byte-level BPE that a tiktoken file stands for exactly:
    Llama 3's pre-tokenizer, no normalizer, ranks 0..n-1, then the special tokens that `Tokenizer.from_file` numbers
    after them (not Qwen's: folder_tokenizer reads it). Anything else is a ValueError naming the first difference."""
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    meta_file, hf_file = hf_dir / "original" / "tokenizer.model", hf_dir / "tokenizer.json"
    if meta_file.is_file():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(meta_file, out_path)
    elif hf_file.is_file():
        ranks = ranks_for_tiktoken_file(hf_file)
        lines = [b"%s %d\n" % (base64.b64encode(t), r) for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_bytes(b"".join(lines))
    else:
        raise FileNotFoundError(f"{hf_dir} has neither tokenizer.json nor original/tokenizer.model")
    return build_tokenizer(str(out_path))


def folder_tokenizer(hf_dir: str | Path) -> Tokenizer | None:
    """The tokenizer of a Hugging Face folder, read in memory; None when the folder has none. What a tiktoken file
    holds loads by load_hf_tokenizer's rules; any other tokenizer.json we reproduce exactly (Qwen's: its regex, NFC,
    its added tokens with their ids) with BOS and EOS from tokenizer_config.json (_bos_eos)."""
    meta_file, hf_file = Path(hf_dir) / "original" / "tokenizer.model", Path(hf_dir) / "tokenizer.json"
    if meta_file.is_file():
        return Tokenizer.from_file(meta_file)
    if not hf_file.is_file():
        return None
    read = read_tokenizer_json(hf_file)
    if tiktoken_file_problem(read) is None:
        return Tokenizer(Path(hf_dir).name, read.ranks, tiktoken_file_specials(read.ranks))
    bos, eos = _bos_eos(Path(hf_dir), read.added)
    return Tokenizer(Path(hf_dir).name, read.ranks, read.added, pattern=read.pattern, nfc=read.nfc, bos=bos, eos=eos,
                     in_text=read.in_text)


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


def run_vocab_size(cfg: JobConfig, tokenizer: Tokenizer) -> int:
    """The model's vocabulary in the run `cfg` configures: the tokenizer's ids, or where the Hugging Face folder the
    run starts from pads its embedding beyond them (config.json's vocab_size: Qwen3's 151936 rows for 151669 ids),
    the folder's, so that its weights load; a smaller one is refused by check_hf. By the config alone, as above."""
    ck = cfg.checkpoint
    if not (ck.initial_load_in_hf and ck.initial_load_path):
        return tokenizer.n_words
    try:
        padded = json.loads((Path(ck.initial_load_path) / "config.json").read_text())["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):  # check_hf names what is wrong with the folder
        return tokenizer.n_words
    return padded if isinstance(padded, int) and padded > tokenizer.n_words else tokenizer.n_words


def _bos_eos(hf_dir: Path, added: dict[str, int]) -> tuple[str | None, str]:
    """BOS and EOS by name: tokenizer_config.json's bos_token and eos_token (Qwen3: no BOS, EOS <|im_end|> or, for a
    base model, <|endoftext|>); without the file or key, <|begin_of_text|> if present, and the first of
    <|endoftext|> and <|end_of_text|> present."""
    try:
        config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        config = {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{hf_dir}/tokenizer_config.json cannot be read: {e}") from None

    def named(key: str) -> str | None:
        value = config.get(key)
        return value.get("content") if isinstance(value, dict) else value  # older files: an AddedToken's fields

    bos = named("bos_token") if "bos_token" in config else (BOS if BOS in added else None)
    eos = named("eos_token") or next((name for name in ("<|endoftext|>", EOS) if name in added), None)
    if eos is None:
        raise ValueError(f"{hf_dir}: no EOS: tokenizer_config.json names no eos_token, and neither <|endoftext|> nor "
                         f"{EOS} is among its added tokens")
    for key, name in (("bos_token", bos), ("eos_token", eos)):
        if name is not None and name not in added:
            raise ValueError(f"{hf_dir}/tokenizer_config.json: {key} {name!r} is not one of tokenizer.json's added "
                             "tokens")
    return bos, eos


