"""Files, token shards and pretokenize (torchtitan_lite/data/files.py, scripts/pretokenize.py): text and JSON lines
files become documents, shards hold the same tokens as tokenizing on the fly, and a bad path or corpus is one line."""

import gzip

import pytest
import torch

from tests.test_data import BPE, BYTES, DOCS, bad, corpus, pretokenize, stream, write_jsonl  # noqa: F401 (a fixture)
from torchtitan_lite.data import files as datasets
from torchtitan_lite.data.loader import build_source
from torchtitan_lite.data.tokenizer import BOS, EOS, STDLIB_BPE, Tokenizer


def test_text_files_are_one_document_each(tmp_path):
    for name, text in [("a.txt", "first file\n\nstill the first document"), ("b.txt", ""), ("c.txt", "second")]:
        (tmp_path / name).write_text(text)
    source = build_source("text", f"{tmp_path}/c.txt,{tmp_path}", 7, BYTES, seed=0)  # c first, then a (b is empty)
    expected = stream(["second", "first file\n\nstill the first document"], BYTES)
    assert source.chunks[0].tolist() == expected


def test_gzipped_jsonl_reads_like_plain(tmp_path, corpus):
    plain = write_jsonl(tmp_path / "plain.jsonl", DOCS)
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as f:
        f.write(plain.read_text())
    source = build_source("jsonl", str(tmp_path / "docs.jsonl.gz"), 15, BYTES, 0)
    assert source.chunks[0].tolist() == build_source("jsonl", str(plain), 15, BYTES, 0).chunks[0].tolist()
    assert build_source("jsonl", f"{plain},{plain}", 15, BYTES, 0).n_tokens == source.n_tokens  # each file once


@pytest.mark.parametrize("tok", [BYTES, BPE], ids=["bytes", "stdlib_bpe"])
def test_pretokenize_equals_on_the_fly_tokenization(tmp_path, corpus, tok):
    tok_path = "" if tok is BYTES else str(STDLIB_BPE)
    out = tmp_path / "shards"
    pretokenize.main(["--dataset", "jsonl", "--dataset_path", corpus, "--tokenizer_path", tok_path,
                      "--output", str(out), "--workers", "2"])
    assert sorted(p.name for p in out.iterdir()) == ["00000000.bin", "00000001.bin"]
    header = datasets.read_shard_header(out / "00000000.bin")
    assert header["dtype"] == "uint16" and header["tokenizer"] == tok.identity and header["vocab_size"] == tok.n_words
    on_the_fly, shards = build_source("jsonl", corpus, 15, tok, 0), build_source("tokens", str(out), 15, tok, 0)
    assert shards.n_tokens == len(stream(DOCS, tok)) and shards.n == on_the_fly.n
    idx = torch.arange(3 * shards.n)  # three epochs
    assert torch.equal(shards.windows(idx), on_the_fly.windows(idx))


def test_large_vocabularies_are_written_as_uint32(tmp_path):
    class BigVocab:  # only what write_shard and open_shard look at
        n_words, identity = 100_000, "big"

    tokens = datasets.tokenize_documents(iter([]), BigVocab)
    tokens.extend([99_999, 5, 70_000])
    datasets.write_shard(tmp_path / "s.bin", iter([tokens]), BigVocab)
    assert datasets.read_shard_header(tmp_path / "s.bin")["dtype"] == "uint32"
    assert datasets.open_shard(tmp_path / "s.bin", BigVocab).tolist() == [99_999, 5, 70_000]




def test_bad_paths_and_corpora_are_config_errors_naming_the_file(tmp_path):
    with bad("nope.jsonl does not exist"):
        build_source("jsonl", str(tmp_path / "nope.jsonl"), 8, BYTES, 0)
    with bad(r"training.dataset_path: '.*\*.missing' matches no file"):
        build_source("text", str(tmp_path / "*.missing"), 8, BYTES, 0)
    with bad("validation.dataset_path is empty"):
        build_source("jsonl", "", 8, BYTES, 0, split="validation")
    (tmp_path / "empty.txt").write_text("")
    with bad("hold no text"):
        build_source("text", str(tmp_path / "empty.txt"), 8, BYTES, 0)
    (tmp_path / "short.txt").write_text("tiny")
    with bad("holds 6 tokens, fewer than one window of seq_len \\+ 1 = 9"):
        build_source("text", str(tmp_path / "short.txt"), 8, BYTES, 0)
    with bad("'wikipedia' is unknown: use one of synthetic, python_stdlib"):
        build_source("wikipedia", "", 8, BYTES, 0)
    with bad("must be empty for python_stdlib"):
        build_source("python_stdlib", str(tmp_path), 8, BYTES, 0)


def test_jsonl_lines_without_the_text_field_are_named(tmp_path, capsys):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "ok"}\n\n{"content": "no text field"}\n')
    with bad(f"{path}:3: no string field 'text'.*training.dataset_text_field"):
        build_source("jsonl", str(path), 8, BYTES, 0)
    path.write_text('{"content": "first"}\n{"content": "second", "text": 1}\n')
    assert build_source("jsonl", str(path), 2, BYTES, 0, text_field="content").n_tokens == 5 + 6 + 4
    path.write_text('{"text": "ok"}\nnot json\n')
    with bad(f"{path}:2: not a JSON object"):
        build_source("jsonl", str(path), 8, BYTES, 0)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        pretokenize.main(["--dataset", "jsonl", "--dataset_path", str(path), "--tokenizer_path", "",
                          "--output", str(out), "--workers", "1"])
    assert exit_.value.code == 2 and f"error: {path}:2: not a JSON object" in capsys.readouterr().err
    assert not list(out.iterdir())  # no partial corpus left behind


def test_shards_are_checked_against_the_tokenizer(tmp_path):
    shard = tmp_path / "00000.bin"
    datasets.write_shard(shard, iter([datasets.tokenize_documents(iter(DOCS), BPE)]), BPE)
    with bad(f"{shard} holds token id 2049 .* the model's vocabulary has 258"):
        build_source("tokens", str(tmp_path), 8, BYTES, 0)
    reversed_bytes = Tokenizer("reversed", {bytes([i]): 255 - i for i in range(256)}, [BOS, EOS])  # same size
    datasets.write_shard(shard, iter([datasets.tokenize_documents(iter(DOCS), BYTES)]), BYTES)
    with bad(f"{shard} was written with tokenizer {BYTES.identity} but .* gives tokenizer {reversed_bytes.identity}"):
        build_source("tokens", str(shard), 8, reversed_bytes, 0)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 2)
    with bad(f"{shard} should be .* truncated"):
        build_source("tokens", str(shard), 8, BYTES, 0)
    (tmp_path / "00001.bin").write_bytes(b"\x00" * 1000)
    with bad(f"{tmp_path / '00001.bin'} is not a token shard"):
        build_source("tokens", str(tmp_path / "00001.bin"), 8, BYTES, 0)
