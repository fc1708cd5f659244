import base64
import collections
import heapq
import inspect
import json
import json.decoder
import random
import re
import string
import textwrap
import warnings

import pytest

from torchtitan_lite.data.hf_tokenizer import load_hf_tokenizer, save_hf_tokenizer
from torchtitan_lite.data.tokenizer import BOS, EOS, LLAMA3_PAT, STDLIB_BPE, Tokenizer

# Test-only dependencies: the runtime writes and reads Hugging Face's JSON without them.
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TOKENIZERS = {"bytes": Tokenizer.byte_level(), "stdlib_bpe": Tokenizer.from_file(STDLIB_BPE)}

MULTILINGUAL = "\n".join(
    [
        "中文：我们在训练大型语言模型，数字 12345 和全角的６７８。",
        "Emoji: 🙂👍🏽 👨‍👩‍👧 🇫🇷 ❤️ and 🙂🙂🙂",
        "Accents: café, naïve, Ångström, cafe\u0301 (combining), Œuvre, Straße, ÀÉÎÕÜ",
        "Кириллица: Привет, мир! ЁЖИК ёжик — «цитата».",
        "العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया. 日本語のテキスト、한국어 텍스트.",
        "Windows line\r\nends\r\n\r\n  indented\r\n",
        "tabs\t\tand    long     runs" + " " * 300 + "x\n" + "\t" * 50 + "\n" * 20 + "   \n \n",
        "digits 12345 1234567890 3.14159 1e-10 0x1F 1,000,000",
        "contractions: it's I'M we'LL they'd YOU'RE don't",
        "odd spaces: nbsp\u00a0here, line sep\u2028para sep\u2029, nul\x00, bell\x07, ideographic\u3000space",
    ]
)


def texts() -> dict[str, str]:
    sources = {m.__name__: inspect.getsource(m) for m in (textwrap, json.decoder, collections, string, heapq)}
    sources["heapq_crlf"] = sources["heapq"].replace("\n", "\r\n")
    sources["multilingual"] = MULTILINGUAL
    sources["joined"] = "\n\n".join([sources["string"], MULTILINGUAL, sources["textwrap"], MULTILINGUAL[::-1]])
    return sources


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def exported(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    save_hf_tokenizer(TOKENIZERS[request.param], out)
    return TOKENIZERS[request.param], out


def test_transformers_encodes_and_decodes_real_text_exactly_as_we_do(exported):
    ours, out = exported
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert len(hf) == ours.n_words
    for name, text in texts().items():
        ids = ours.encode(text, bos=True, eos=False)
        assert hf(text)["input_ids"] == ids, name
        assert hf.decode(ids) == ours.decode(ids) == BOS + text, name
        assert hf.decode(ids, skip_special_tokens=True) == text, name


def test_special_token_names_in_text_are_plain_text_only_when_asked(exported):
    # Our encode never emits a special id for text; transformers does unless split_special_tokens=True.
    ours, out = exported
    hf = transformers.AutoTokenizer.from_pretrained(out)
    text = "end <|end_of_text|><|begin_of_text|> of story"
    ids = ours.encode(text, bos=True, eos=False)
    assert hf(text, split_special_tokens=True)["input_ids"] == ids
    assert ours.eos_id in hf(text)["input_ids"] and ours.eos_id not in ids


def test_tokenizers_library_reads_the_file_alone(exported):
    ours, out = exported
    hf = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for name, text in texts().items():
        ids = ours.encode(text, bos=True, eos=False)
        assert hf.encode(text).ids == ids, name
        assert hf.decode(ids, skip_special_tokens=False) == BOS + text, name
    assert hf.token_to_id(EOS) == ours.eos_id


@pytest.mark.parametrize("seed", range(4))
def test_merges_reproduce_tiktoken_for_ranks_no_trainer_would_make(tmp_path, seed):
    # Random multi-byte tokens in random rank order: longer tokens ranked before their parts, tokens that BPE never
    # reaches, several ways to build one token. Words of these letters are single pre-tokens, so BPE decides alone.
    rng = random.Random(seed)
    multi = sorted({"".join(rng.choices("abc", k=rng.randint(2, 6))).encode() for _ in range(150)})
    rng.shuffle(multi)
    ranks = {bytes([i]): i for i in range(256)} | {t: 256 + r for r, t in enumerate(multi)}
    ours = Tokenizer("random", ranks, [BOS, EOS])
    save_hf_tokenizer(ours, tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert 0 < len(spec["model"]["merges"]) < len(multi)  # some tokens are reached by whole-word look-up only

    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    words = ["".join(rng.choices("abc", k=rng.randint(1, 40))) for _ in range(3000)]
    words += [t.decode() for t in multi]
    for word in words:
        assert hf.encode(word).ids == ours.encode(word, bos=True, eos=False), word


def ranks_in_order(tok: Tokenizer) -> list[bytes]:
    return [tok.model.decode_single_token_bytes(i) for i in range(tok.n_words - len(tok.special_tokens))]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_round_trip_gives_back_the_same_tokenizer(tmp_path, name):
    ours = TOKENIZERS[name]
    save_hf_tokenizer(ours, tmp_path / "hf")
    back = load_hf_tokenizer(tmp_path / "hf", tmp_path / "back.tiktoken")
    assert ranks_in_order(back) == ranks_in_order(ours)
    assert back.special_tokens == ours.special_tokens
    assert back.identity == ours.identity
    if name == "stdlib_bpe":
        assert (tmp_path / "back.tiktoken").read_bytes() == STDLIB_BPE.read_bytes()


def test_llama3_sized_vocabulary_keeps_its_256_special_tokens(tmp_path):
    # Llama 3's size without its content (as in test_tokenizer): Tokenizer.from_file numbers Meta's specials.
    tokens = [bytes([i]) for i in range(256)] + [i.to_bytes(3, "big") for i in range(256, 128_000)]
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    ours = Tokenizer.from_file(path)
    save_hf_tokenizer(ours, tmp_path / "hf", model_max_length=8192)
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert hf.token_to_id("<|eot_id|>") == 128_009 and hf.token_to_id("<|reserved_special_token_250|>") == 128_255
    assert hf.encode("Hi 🙂").ids == ours.encode("Hi 🙂", bos=True, eos=False)
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 8192 and len(config["added_tokens_decoder"]) == 256
    back = load_hf_tokenizer(tmp_path / "hf", tmp_path / "back.tiktoken")
    assert back.identity == ours.identity and back.n_words == 128_256


def test_tokenizer_json_made_by_transformers_converter_loads_without_warning(tmp_path):
    # Hugging Face's own tiktoken conversion lists every split of each token: more merges, the same BPE.
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converted = TikTokenConverter(str(STDLIB_BPE), pattern=LLAMA3_PAT, extra_special_tokens=[BOS, EOS]).converted()
    converted.save(str(tmp_path / "tokenizer.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = load_hf_tokenizer(tmp_path, tmp_path / "out.tiktoken")
    ours = TOKENIZERS["stdlib_bpe"]
    assert back.identity == ours.identity
    text = texts()["joined"]
    assert converted.encode(text).ids == ours.encode(text, bos=False, eos=False)


def test_meta_tiktoken_file_is_preferred_and_copied(tmp_path):
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "tokenizer.model").write_bytes(STDLIB_BPE.read_bytes())
    save_hf_tokenizer(TOKENIZERS["bytes"], tmp_path)  # a tokenizer.json that disagrees: not read
    back = load_hf_tokenizer(tmp_path, tmp_path / "out" / "tok.tiktoken")
    assert back.identity == TOKENIZERS["stdlib_bpe"].identity


def test_vocab_ids_in_any_order_are_kept_as_ranks(tmp_path):
    ours = TOKENIZERS["bytes"]
    save_hf_tokenizer(ours, tmp_path)
    path = tmp_path / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    chars = list(spec["model"]["vocab"])
    random.Random(0).shuffle(chars)
    spec["model"]["vocab"] = {c: i for i, c in enumerate(chars)}
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")

    back = load_hf_tokenizer(tmp_path, tmp_path / "shuffled.tiktoken")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = MULTILINGUAL + texts()["string"]
    assert back.encode(text, bos=True, eos=False) == hf(text)["input_ids"]
    assert back.encode(text, bos=False, eos=False) != ours.encode(text, bos=False, eos=False)
    assert back.decode(back.encode(text, bos=False, eos=False)) == text


def edit(spec: dict, what: str) -> None:
    if what == "gpt2_pre_tokenizer":
        spec["pre_tokenizer"] = {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        }
    elif what == "other_regex":
        spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = LLAMA3_PAT.replace("{1,3}", "")
    elif what == "renamed_eos":
        spec["added_tokens"][1]["content"] = "</s>"
    elif what == "extra_special":
        spec["added_tokens"].append({**spec["added_tokens"][1], "id": 2050, "content": "<pad>"})
    elif what == "specials_first":
        spec["added_tokens"][0]["id"] = 0
        spec["model"]["vocab"] = {t: i + 1 for t, i in spec["model"]["vocab"].items()}
    elif what == "lowercases":
        spec["normalizer"] = {"type": "Lowercase"}


@pytest.mark.parametrize(
    "what, named",
    [
        ("gpt2_pre_tokenizer", "pre-tokenizer is ['ByteLevel']"),
        ("other_regex", "regex"),
        ("renamed_eos", "special token #1 is '</s>' with id 2049; after 2048 ranks, ours is '<|end_of_text|>'"),
        ("extra_special", "special token #2 is '<pad>' with id 2050"),
        ("specials_first", "no token has id 0"),
        ("lowercases", "Lowercase"),
    ],
)
def test_tokenizer_we_cannot_reproduce_is_refused_in_one_line(tmp_path, what, named):
    save_hf_tokenizer(TOKENIZERS["stdlib_bpe"], tmp_path)
    path = tmp_path / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    edit(spec, what)
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer.json: cannot convert") as err:
        load_hf_tokenizer(tmp_path, tmp_path / "out.tiktoken")
    assert named in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out.tiktoken").exists()


def test_wordpiece_is_refused(tmp_path):
    wordpiece = tokenizers.models.WordPiece({"[UNK]": 0, "hello": 1, "##s": 2}, unk_token="[UNK]")
    tokenizers.Tokenizer(wordpiece).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="its model is WordPiece, not a byte-level BPE") as err:
        load_hf_tokenizer(tmp_path, tmp_path / "out.tiktoken")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "change, warning",
    [("last_merge_first", "applied later than its rank"), ("drop_a_merge", "it has no merge 'ĠĠ' + 'Ġ'")],
)
def test_merges_that_disagree_with_the_ids_load_with_a_warning(tmp_path, change, warning):
    save_hf_tokenizer(TOKENIZERS["stdlib_bpe"], tmp_path)
    path = tmp_path / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    merges = spec["model"]["merges"]
    if change == "last_merge_first":
        merges.insert(0, merges.pop())
    else:
        merges.remove(["ĠĠ", "Ġ"])
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    with pytest.warns(UserWarning, match=re.escape(warning)):
        back = load_hf_tokenizer(tmp_path, tmp_path / "out.tiktoken")
    assert back.identity == TOKENIZERS["stdlib_bpe"].identity  # the ranks are the ids all the same


def test_missing_tokenizer_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor original/tokenizer.model"):
        load_hf_tokenizer(tmp_path, tmp_path / "out.tiktoken")
