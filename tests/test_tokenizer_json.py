"""A Qwen-style tokenizer.json, made by the `tokenizers` library itself, loads with Hugging Face's ids exactly
(torchtitan_lite/data/tokenizer_json.py, hf_tokenizer.folder_tokenizer): Qwen2/Qwen3's NFC normalizer, Split regex
(digits one by one) and ByteLevel steps, a BPE trained by `tokenizers`, added tokens after the ranks (special ones,
and non-special ones that text holds as tokens, as Qwen3's <think>), no BOS. What tiktoken cannot reproduce is
refused in one line. (tests/test_hf_load.py starts a run from a folder of it, with a padded vocabulary.)"""

import inspect
import json
import shutil
import textwrap
import unicodedata
from pathlib import Path

import pytest

from tests.multiprocess.launch import TINY
from tests.test_hf_tokenizer import texts
from torchtitan_lite.config import load_config
from torchtitan_lite.data.hf_tokenizer import (folder_tokenizer, load_hf_tokenizer, run_tokenizer, run_vocab_size,
                                               save_hf_tokenizer)

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

QWEN_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
            r"|\s+(?!\S)|\s+")
SPECIAL, IN_TEXT = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"]
N_RANKS = 1000
CORPUS = [
    "digits 12345 and 3.14159, ６７８ full width",
    "NFC: cafe\u0301 vs café, A\u030a vs Å, \u1e9b\u0323",
    "lines\n\n\r\n  indented\n\t\ttabs" + " " * 40 + "x\n" + "\n" * 5,
    "punctuation!!! ... ?!; (a, b) -> {c: [d]} #$%^&*",
    "中文：我们在训练大型语言模型。日本語、한국어",
    "emoji 🙂👍🏽 👨‍👩‍👧 🇫🇷",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nhi<|im_end|><|endoftext|>",
    "<think><think></think>x</think ><thinking>",
    "it's I'M we'LL",
]


def qwen_style_folder(path: Path, eos: str | None = "<|im_end|>") -> Path:
    """tokenizer.json as Qwen's (a BPE of N_RANKS trained on a few stdlib modules, then its added tokens) and, unless
    eos is None, a tokenizer_config.json like Qwen3's instruct models' (no BOS; a base model's EOS is <|endoftext|>)."""
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.normalizer = tokenizers.normalizers.NFC()
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN_PAT), behavior="isolated", invert=False),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    bpe.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=N_RANKS, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([inspect.getsource(m) for m in (textwrap, json, shutil)], trainer)
    bpe.add_special_tokens(SPECIAL)
    bpe.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in IN_TEXT])
    path.mkdir(parents=True, exist_ok=True)
    bpe.save(str(path / "tokenizer.json"))
    if eos:
        config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": eos,
                  "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False, "split_special_tokens": False}
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return qwen_style_folder(tmp_path_factory.mktemp("qwen") / "hf")


def corpus() -> dict[str, str]:
    return {**texts(), **{f"corpus_{i}": text for i, text in enumerate(CORPUS)}}


def raw_tokenizer(folder: Path):
    """`tokenizers` on the file alone, special tokens' names read as text (as our encode does)."""
    hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf.encode_special_tokens = True
    return hf


def test_ids_are_hugging_faces_on_a_varied_corpus(folder):
    ours = folder_tokenizer(folder)
    assert (ours.n_words, ours.bos_id, ours.eos_id, ours.special_tokens["<think>"]) == (1005, None, 1002, 1003)
    raw, auto = raw_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)  # Qwen2Tokenizer
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    assert type(auto).__name__ == "Qwen2Tokenizer" and auto.bos_token_id is None and auto.eos_token_id == ours.eos_id
    for name, text in corpus().items():
        ids = ours.encode(text, bos=True, eos=False)  # no BOS to add
        assert ids == raw.encode(text).ids, name
        assert ids == auto(text, split_special_tokens=True)["input_ids"], name
        assert ids == fast(text, split_special_tokens=True)["input_ids"], name
        assert ours.decode(ids) == unicodedata.normalize("NFC", text) == raw.decode(ids, skip_special_tokens=False)


def test_qwens_conventions_hold(folder):
    ours = folder_tokenizer(folder)
    digits = ours.encode("12345", bos=False, eos=False)
    assert [ours.decode([i]) for i in digits] == list("12345")  # one token per digit, not Llama 3's runs of three
    assert ours.encode("cafe\u0301", bos=False, eos=False) == ours.encode("café", bos=False, eos=False)  # NFC
    # A document is its text + EOS; special names are plain text, but <think> is a token wherever it is written.
    assert ours.encode("hi", bos=True, eos=True) == ours.encode("hi", bos=False, eos=False) + [1002]
    ids = ours.encode("<|im_end|><think>", bos=False, eos=False)
    assert 1002 not in ids and ids[-1] == 1003 and ours.decode(ids) == "<|im_end|><think>"


@pytest.mark.parametrize("eos, expected", [("<|endoftext|>", 1000), (None, 1000)])
def test_eos_is_tokenizer_configs_or_endoftext(tmp_path, eos, expected):
    """A base model's tokenizer_config.json says <|endoftext|>; without the file, <|endoftext|> by convention."""
    ours = folder_tokenizer(qwen_style_folder(tmp_path, eos=eos))
    assert (ours.bos_id, ours.eos_id) == (None, expected)


def test_a_run_from_the_folder_takes_its_tokenizer_and_its_padded_vocabulary(folder, tmp_path):
    folder = Path(shutil.copytree(folder, tmp_path / "hf"))
    cfg = load_config(["--job.config_file", str(TINY), "--checkpoint.initial_load_in_hf",
                       "--checkpoint.initial_load_path", str(folder), "--model.tokenizer_path", ""])
    ours = run_tokenizer(cfg)
    assert ours.identity == folder_tokenizer(folder).identity and run_vocab_size(cfg, ours) == 1005  # no config.json
    for vocab_size, expected in [(1024, 1024), (900, 1005)]:  # padding is the folder's; fewer rows check_hf refuses
        (folder / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
        assert run_vocab_size(cfg, ours) == expected


def test_our_export_of_it_reads_back_and_encodes_alike_in_transformers(folder, tmp_path):
    ours = folder_tokenizer(folder)
    save_hf_tokenizer(ours, tmp_path)
    back, theirs = folder_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert back.identity == ours.identity and theirs.bos_token_id is None and theirs.eos_token_id == ours.eos_id
    for name, text in corpus().items():
        assert theirs(text, split_special_tokens=True)["input_ids"] == ours.encode(text, bos=True, eos=False), name


def edit(spec: dict, what: str) -> None:
    split = spec["pre_tokenizer"]["pretokenizers"][0]
    if what == "drops_spaces":
        split["pattern"]["Regex"] = r"\p{L}+|\p{N}|[^\s\p{L}\p{N}]+"
    elif what == "engine_refuses":
        split["pattern"]["Regex"] = r"\p{L}+|[a-"
    elif what == "nfkc":
        spec["normalizer"] = {"type": "NFKC"}
    elif what == "lstrip":
        spec["added_tokens"][-1]["lstrip"] = True
    elif what == "gap":  # tiktoken would take it, but `tokenizers` renumbers </think> 1004, warning
        spec["added_tokens"][-1]["id"] = 1010
    elif what == "among_ranks":
        spec["added_tokens"][0]["id"] = 5


@pytest.mark.parametrize("what, named", [
    ("drops_spaces", "matches no text at ' ', which tiktoken would drop"),
    ("engine_refuses", "tiktoken's regex engine refuses its pre-tokenizer regex"),
    ("nfkc", "it normalizes text first (NFKC), ours only by NFC"),
    ("lstrip", "its added token '</think>' matches with ['lstrip'], ours only as written"),
    ("gap", "its added token '</think>' has id 1010, but Hugging Face's tokenizers numbers it 1004 (the next free"),
    ("among_ranks", "its added token '<|endoftext|>' has id 5, but Hugging Face's tokenizers numbers it 1000"),
])
def test_what_tiktoken_cannot_reproduce_is_refused_in_one_line(tmp_path, folder, what, named):
    shutil.copy(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    spec = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    edit(spec, what)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer.json: cannot convert") as err:
        folder_tokenizer(tmp_path)
    assert named in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_without_eos_or_with_an_unknown_one_it_is_refused_in_one_line(tmp_path, folder):
    shutil.copy(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    spec = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    spec["added_tokens"][0]["content"] = "<|pad|>"  # no <|endoftext|>, and no tokenizer_config.json
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(ValueError, match="no EOS: tokenizer_config.json names no eos_token, and neither"):
        folder_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match="eos_token '</s>' is not one of tokenizer.json's added tokens"):
        folder_tokenizer(tmp_path)


def test_a_tiktoken_file_cannot_stand_for_it(folder, tmp_path):
    """load_hf_tokenizer writes a tiktoken file, which would load with Llama 3's regex and our BOS/EOS: refused."""
    with pytest.raises(ValueError, match="its pre-tokenizer regex .* is not Llama 3's, which a tiktoken file implies"):
        load_hf_tokenizer(folder, tmp_path / "out.tiktoken")
    assert not (tmp_path / "out.tiktoken").exists()
