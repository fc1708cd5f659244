import base64
import importlib.util
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import tiktoken

from torchtitan_lite.data.tokenizer import LLAMA3_PAT, MAX_CHARS, STDLIB_BPE, Tokenizer, build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_tokenizer", ROOT / "scripts" / "train_tokenizer.py")
train_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_tokenizer)

TOKENIZERS = {"bytes": Tokenizer.byte_level(), "stdlib_bpe": Tokenizer.from_file(STDLIB_BPE)}


def random_text(rng: random.Random, n: int) -> str:
    # ASCII, Latin, combining marks, Cyrillic, CJK, emoji (outside the BMP), odd whitespace and controls.
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x400, 0x4FF), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF)]
    chars = [chr(rng.randint(*rng.choice(ranges))) for _ in range(n)]
    chars += rng.choices(["\n", "\r\n", "\t", " ", "  ", "\u00a0", "\u2028", "\x00", "'s", "123456"], k=n // 5)
    rng.shuffle(chars)
    return "".join(chars)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_round_trip_on_arbitrary_unicode_and_long_runs(name):
    tok, rng = TOKENIZERS[name], random.Random(0)
    texts = [random_text(rng, n) for n in (1, 10, 1000, 20_000)]
    texts += ["", "a" * 100_000, " " * 100_000, "\n" * 30_000, "ab" * 30_000 + " " * 60_000 + "\U0001f600" * 30_000]
    texts += ["x = f(y)  # ok\n" * 40_000]  # longer than one piece of MAX_CHARS
    for text in texts:
        ids = tok.encode(text, bos=False, eos=False)
        assert all(0 <= i < tok.n_words for i in ids)
        assert tok.decode(ids) == text


def test_cutting_long_normal_text_keeps_the_tokens():
    tok = TOKENIZERS["stdlib_bpe"]
    text = (ROOT / "torchtitan_lite" / "data" / "tokenizer.py").read_text()
    text = text * (2 * MAX_CHARS // len(text) + 1)
    assert tok.encode(text, bos=False, eos=False) == tok.model.encode_ordinary(text)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_special_token_names_in_text_are_plain_text(name):
    tok = TOKENIZERS[name]
    text = "end <|end_of_text|><|begin_of_text|> of story"
    ids = tok.encode(text, bos=False, eos=False)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == text


@pytest.mark.parametrize("name", TOKENIZERS)
def test_bos_eos_placement(name):
    tok = TOKENIZERS[name]
    plain = tok.encode("hello world", bos=False, eos=False)
    assert tok.encode("hello world", bos=True, eos=False) == [tok.bos_id] + plain
    assert tok.encode("hello world", bos=False, eos=True) == plain + [tok.eos_id]
    assert tok.encode("", bos=True, eos=True) == [tok.bos_id, tok.eos_id]
    assert tok.decode([tok.bos_id] + plain) == "<|begin_of_text|>hello world"


def test_byte_level_and_asset_vocabularies():
    byte, bpe = TOKENIZERS["bytes"], TOKENIZERS["stdlib_bpe"]
    assert (byte.n_words, byte.bos_id, byte.eos_id) == (258, 256, 257)
    assert (bpe.n_words, bpe.bos_id, bpe.eos_id) == (2050, 2048, 2049)
    assert build_tokenizer("").identity == byte.identity
    assert build_tokenizer(str(STDLIB_BPE)).identity == bpe.identity
    assert len(byte.identity) == 16 and byte.identity != bpe.identity


def test_asset_compresses_held_out_text():
    # This repo's own code was not in the training set (the standard library was).
    text = "".join(p.read_text() for p in sorted((ROOT / "torchtitan_lite").rglob("*.py")))
    tok = TOKENIZERS["stdlib_bpe"]
    assert len(text.encode()) / len(tok.encode(text, bos=False, eos=False)) > 2.0


def test_decode_of_a_partial_character_does_not_raise():
    tok = TOKENIZERS["bytes"]
    ids = tok.encode("€", bos=False, eos=False)
    assert len(ids) == 3 and tok.decode(ids[:2]) == "\ufffd"


def naive_bpe(word_counts: Counter, vocab_size: int) -> list[bytes]:
    """The textbook algorithm, recounting every pair each step, as a reference for the incremental trainer."""
    tokens = [bytes([i]) for i in range(256)]
    words = {tuple(bytes([b]) for b in w): n for w, n in word_counts.items()}
    while len(tokens) < vocab_size:
        pairs = Counter()
        for w, n in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if best[0] + best[1] not in tokens:
            tokens.append(best[0] + best[1])
        merged = Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if w[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return tokens


def read_independently(path: Path) -> dict[bytes, int]:
    lines = path.read_text().splitlines()
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines)}


def test_trainer_writes_a_deterministic_tiktoken_file(tmp_path, capsys):
    rng = random.Random(1)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = ["the", "cat", "sat", "on", "mat", "déjà", "vu", "日本語", "🙂", "aaaa", "12345", "it's"]
    for i in range(3):
        (corpus / f"{i}.txt").write_text(" ".join(rng.choices(words, k=2000)) + "\n")
    outputs = [tmp_path / "a.tiktoken", tmp_path / "b.tiktoken"]
    for out in outputs:
        train_tokenizer.main(["--input", str(corpus / "*.txt"), "--vocab_size", "280", "--output", str(out)])
    assert "bytes/token" in capsys.readouterr().out
    assert outputs[0].read_bytes() == outputs[1].read_bytes()

    ranks = read_independently(outputs[0])
    assert sorted(ranks.values()) == list(range(280))
    enc = tiktoken.Encoding("t", pat_str=LLAMA3_PAT, mergeable_ranks=ranks, special_tokens={})
    assert enc.decode(enc.encode_ordinary("the cat sat on the mat 🙂")) == "the cat sat on the mat 🙂"
    assert len(enc.encode_ordinary("the cat sat")) < len("the cat sat")

    texts = [p.read_text() for p in sorted(corpus.glob("*.txt"))]
    assert list(ranks) == naive_bpe(train_tokenizer.count_words(texts), 280)


def test_a_jsonl_corpus_trains_on_its_text_field_only(tmp_path, capsys):
    """As pretokenize.py and the trainer read it: the field named by --text_field, not the JSON around it (read as raw
    text, `{"`, `":` and the keys became merges)."""
    rng = random.Random(2)
    words = ["the", "cat", "sat", "on", "mat", "déjà", "vu", "日本語", "🙂", "12345"]
    docs = [" ".join(rng.choices(words, k=6)) + "\n" for _ in range(300)]  # short lines: the JSON is a third of it
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "meta": "lorem ipsum dolor", "body": d}) + "\n"
                              for i, d in enumerate(docs)))
    out = tmp_path / "bpe.tiktoken"
    args = ["--dataset_path", str(corpus), "--text_field", "body", "--vocab_size", "300", "--output", str(out)]
    assert train_tokenizer.main(["--dataset", "jsonl", *args]) == 0
    assert list(read_independently(out)) == naive_bpe(train_tokenizer.count_words(docs), 300)
    assert "read 300 documents" in capsys.readouterr().out
    # Through --input, a JSON lines file would be read as text: refused, with the options that read it.
    assert train_tokenizer.main(["--input", str(corpus), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--dataset jsonl" in err[0], err
    assert train_tokenizer.main(["--dataset", "jsonl", *args[:2], "--output", str(out)]) == 2  # no "text" field
    assert capsys.readouterr().err.startswith(f"error: {corpus}:1: no string field 'text'")


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"", "empty"),
        (b"YQ== 0\nYg== \n", "line 2"),
        (b"YQ== 0\n!!notbase64 1\n", "line 2: bad base64"),
        (b"YQ== zero\n", "line 1: rank"),
        (b"YQ== 0\nYg== 5\n", "ranks are not"),
        (b"YQ== 0\nYQ== 1\n", "appears twice"),
        (b"YQ== 0\nYg== 1\n", "single bytes"),
    ],
)
def test_malformed_file_is_a_value_error_naming_it(tmp_path, content, problem):
    path = tmp_path / "broken.tiktoken"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="broken.tiktoken is not in tiktoken format") as err:
        Tokenizer.from_file(path)
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.model"):
        build_tokenizer(str(tmp_path / "nope.model"))


def test_llama3_sized_file_gets_llama3_special_tokens(tmp_path):
    # 256 bytes + 127744 distinct 3-byte tokens: Llama 3's size, without its content.
    tokens = [bytes([i]) for i in range(256)] + [i.to_bytes(3, "big") for i in range(256, 128_000)]
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    tok = Tokenizer.from_file(path)
    assert tok.n_words == 128_256 and (tok.bos_id, tok.eos_id) == (128_000, 128_001)
    specials = tok.special_tokens
    assert specials["<|eot_id|>"] == 128_009 and specials["<|start_header_id|>"] == 128_006
    assert specials["<|reserved_special_token_250|>"] == 128_255 and len(specials) == 256
    assert tok.decode(tok.encode("Hi 🙂", bos=True, eos=False)) == "<|begin_of_text|>Hi 🙂"


BYTE_RANKS = {bytes([i]): i for i in range(256)}


def test_a_tokenizer_of_a_folder_may_have_no_bos_nfc_added_tokens_and_id_gaps():
    """What a Hugging Face tokenizer.json can say and a tiktoken file cannot (tests/test_tokenizer_json.py checks a
    Qwen-style one against Hugging Face): a document without BOS is its text + EOS."""
    tok = Tokenizer("qwen_like", BYTE_RANKS, {"<|endoftext|>": 256, "<think>": 257, "<|im_end|>": 260},
                    pattern=LLAMA3_PAT.replace(r"\p{N}{1,3}", r"\p{N}"), nfc=True, bos=None, eos="<|im_end|>",
                    in_text=frozenset({"<think>"}))
    assert (tok.n_words, tok.bos_id, tok.eos_id) == (261, None, 260)
    assert tok.encode("e\u0301", bos=True, eos=True) == [*"é".encode(), 260]
    assert tok.encode("<think><|im_end|>", bos=False, eos=False) == [257, *b"<|im_end|>"]
    assert tok.decode([104, 258, 105, 257, 9999]) == "hi<think>"  # ids of no token decode to nothing
    assert tok.identity != Tokenizer("qwen_like", BYTE_RANKS, ["<|endoftext|>", "<think>", "<|im_end|>"],
                                     bos=None, eos="<|im_end|>").identity


@pytest.mark.parametrize("specials, bos, problem", [
    ({"<a>": 255, "<b>": 256}, None, "not distinct ids above the 256 ranks"),
    ({"<a>": 256, "<b>": 256}, None, "not distinct ids above the 256 ranks"),
    ({"<a>": 256, "<b>": 257}, "<s>", "'<s>' is not one of the special tokens"),
])
def test_special_tokens_a_tokenizer_cannot_hold_are_refused(specials, bos, problem):
    with pytest.raises(ValueError, match=problem):
        Tokenizer("bad", BYTE_RANKS, specials, bos=bos, eos="<b>")
