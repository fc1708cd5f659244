import importlib.util
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import train
from tests.multiprocess.launch import TINY
from torchtitan_lite.config import ConfigError, Training, Validation, load_config
from torchtitan_lite.data import files as datasets
from torchtitan_lite.data.loader import (HOLDOUT, DataLoader, Permutation, TokenSource, build_source, build_sources,
                                         group_share, to_device, warn_if_validating_on_training_data)
from torchtitan_lite.data.synthetic import SyntheticSource
from torchtitan_lite.data.tokenizer import BOS, LLAMA3_N_RANKS, LLAMA3_SPECIALS, STDLIB_BPE, Tokenizer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pretokenize", ROOT / "scripts" / "pretokenize.py")
pretokenize = importlib.util.module_from_spec(_spec)
sys.modules["pretokenize"] = pretokenize  # its pool pickles functions by module name
_spec.loader.exec_module(pretokenize)

BYTES, BPE = Tokenizer.byte_level(), Tokenizer.from_file(STDLIB_BPE)
DOCS = [f"document {i}: " + "héllo wörld, x = f(y)  # 🙂\n" * (i % 7) for i in range(60)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture
def corpus(tmp_path) -> str:
    """Two JSON lines files of DOCS, as a glob."""
    write_jsonl(tmp_path / "a.jsonl", DOCS[:25])
    write_jsonl(tmp_path / "b.jsonl", DOCS[25:])
    return str(tmp_path / "*.jsonl")


def stream(docs: list[str], tok: Tokenizer) -> list[int]:
    return [t for d in docs if d for t in tok.encode(d, bos=True, eos=True)]


def arange_source(total: int, seq_len: int, cuts=(), seed: int = 0) -> TokenSource:
    """A stream whose token i is i (every token unique), held in chunks cut at `cuts`."""
    bounds = [0, *cuts, total]
    chunks = [torch.arange(a, b, dtype=torch.int32) for a, b in zip(bounds, bounds[1:])]
    return TokenSource(chunks, seq_len, seed, "test")


def global_batches(source, dp: int, steps: int, global_batch: int = 8, local_batch: int = 2, state=None):
    """Per step, the union of all dp ranks' inputs and labels, in rank order."""
    loaders = [DataLoader(source, global_batch, min(local_batch, global_batch // dp), r, dp) for r in range(dp)]
    for loader in loaders if state is not None else []:
        loader.load_state_dict(state)
    out = []
    for _ in range(steps):
        micro = [mb for loader in loaders for mb in loader.next_batch()]
        out.append((torch.cat([i for i, _ in micro]), torch.cat([l for _, l in micro])))
    return out, loaders


def bad(match: str):
    return pytest.raises(ConfigError, match=match)


# ---- Packing and order


def test_gpu_batches_are_pinned_and_copied_without_waiting(monkeypatch):
    """A GPU run's loader hands out page-locked batches and to_device copies them asynchronously (a copy from
    pageable memory makes the host wait for the device). This CPU build has no page-locked memory: pinning is
    stubbed by a copy that remembers it was pinned."""
    pinned, copies = set(), []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.add(id(c := t.clone())) or c)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: id(t) in pinned)
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: copies.append(k.get("non_blocking")) or to(t, *a, **k))
    source = arange_source(1000, 8)
    plain = DataLoader(source, 8, 2, 0, 2).next_batch()
    batches = DataLoader(source, 8, 2, 0, 2, pin=True).next_batch()
    assert len(batches) == 2 and all(id(x) in pinned and id(y) in pinned for x, y in batches)
    assert all(torch.equal(a, b) for pair, plain_pair in zip(batches, plain) for a, b in zip(pair, plain_pair))
    for x, _ in batches:
        to_device(x, torch.device("cpu"))
    to_device(plain[0][0], torch.device("cpu"))
    assert copies == [True, True, False]


def test_packing_emits_every_token_exactly_once_per_epoch():
    seq_len, total = 9, 1003  # 100 windows of 10; the 3-token tail is dropped
    source = arange_source(total, seq_len, cuts=(95, 96, 512))  # windows cross chunk boundaries
    assert source.n == 100
    for epoch in range(3):
        w = source.windows(torch.arange(epoch * 100, (epoch + 1) * 100))
        assert torch.equal(w.flatten().sort().values, torch.arange(1000))
        assert torch.equal(w[:, 1:] - w[:, :-1], torch.ones(100, seq_len, dtype=torch.long))  # contiguous runs


def test_documents_are_packed_with_bos_and_eos_in_file_order(corpus):
    source = build_source("jsonl", corpus, 15, BPE, seed=0)
    assert source.chunks[0].tolist() == stream(DOCS, BPE)


def test_without_a_bos_documents_are_packed_as_text_and_eos(corpus):
    """Qwen's tokenizer has no BOS: each document is its text + EOS, which also separates it from the next."""
    no_bos = Tokenizer("no_bos", BYTES.ranks, ["<|endoftext|>"], bos=None, eos="<|endoftext|>")
    tokens = build_source("jsonl", corpus, 15, no_bos, seed=0).chunks[0].tolist()
    assert tokens == [t for d in DOCS if d for t in [*d.encode(), 256]]


def test_permutation_is_a_bijection():
    for n in (1, 2, 3, 5, 64, 1000, 4099):
        perm = Permutation(n, "k")
        assert sorted(perm(i) for i in range(n)) == list(range(n))
    perm = Permutation(10**12, "k")  # O(1) memory: no 8 TB randperm
    big = [perm(i) for i in range(10_000)]
    assert len(set(big)) == 10_000 and 0 <= min(big) and max(big) < 10**12


def test_order_is_reshuffled_every_epoch_and_seeded():
    source = arange_source(1000, 9)
    epochs = [source.order(torch.arange(e * 100, (e + 1) * 100)) for e in range(3)]
    assert epochs[0] != list(range(100))  # the first epoch is shuffled too
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert arange_source(1000, 9).order(torch.arange(300)) == epochs[0] + epochs[1] + epochs[2]  # deterministic
    assert arange_source(1000, 9, seed=1).order(torch.arange(100)) != epochs[0]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_rank_slices_together_are_the_dp1_batch(dp):
    source = arange_source(1003, 9, cuts=(500,))
    ref, _ = global_batches(source, 1, 30)
    got, _ = global_batches(source, dp, 30)
    for (ri, rl), (gi, gl) in zip(ref, got):
        assert torch.equal(ri, gi) and torch.equal(rl, gl)
        assert torch.equal(ri[:, 1:], rl[:, :-1])  # labels are the inputs shifted by one


def test_replica_groups_uneven_shares_together_are_the_global_batch_whoever_is_alive():
    """Live replica groups of 2 ranks share a batch of 14 windows, 7 rows of a micro-batch on each rank (group_share):
    3 groups take 3, 2 and 2 rows, 2 groups 4 and 3, 1 group all 7. Step by step, with the live count changing and
    each step's loaders resumed from the last one's state, their ranks together read the plain run's batches, each
    rank whole micro-batches; the state they save is a plain loader's."""
    source = arange_source(1003, 9)
    ref, plain = global_batches(source, 1, 4, global_batch=14, local_batch=1)
    state = None
    for (inputs, _), live in zip(ref, (3, 2, 1, 3)):
        loaders = [DataLoader(source, 14, 1, r, 2) for _ in range(live) for r in range(2)]
        for i, loader in enumerate(loaders):
            if state:
                loader.load_state_dict(state)
            loader.share = group_share(14, 1, i // 2, live, i % 2, 2)
        micro = [loader.next_batch() for loader in loaders]
        assert [len(m) for m in micro] == {3: [3, 3, 2, 2, 2, 2], 2: [4, 4, 3, 3], 1: [7, 7]}[live]
        assert torch.equal(torch.cat([x for m in micro for x, _ in m]), inputs)
        state = loaders[-1].state_dict()
    assert state == plain[0].state_dict() == {"position": 56, "digest": state["digest"]}


@pytest.mark.parametrize("dp_after", [1, 2, 4])
def test_resume_gives_the_same_next_100_batches_on_any_dp(dp_after):
    source = arange_source(1003, 9)  # 100 windows: 100 batches of 8 run through 8 epochs
    ref, _ = global_batches(source, 1, 107)
    _, loaders = global_batches(source, 2, 7)
    state = loaders[1].state_dict()
    assert state == loaders[0].state_dict() == {"position": 56, "digest": state["digest"]}
    got, _ = global_batches(arange_source(1003, 9), dp_after, 100, state=state)
    for (ri, _), (gi, _) in zip(ref[7:], got):
        assert torch.equal(ri, gi)


def test_synthetic_validation_is_another_part_of_the_same_process():
    train = build_source("synthetic", "", 32, BYTES, seed=3)
    val = build_source("synthetic", "", 32, BYTES, seed=3, split="validation")
    assert isinstance(train, SyntheticSource)
    idx = torch.arange(4)
    assert torch.equal(train.windows(idx), SyntheticSource(32, len(BYTES.ranks), 3).windows(idx))
    v = val.windows(idx)
    assert not torch.equal(v, train.windows(idx))
    follows = train.perm_pow2[0][v[:, :-1]] == v[:, 1:]  # the same permutation walk the model learns in training
    assert follows.float().mean() > 0.7
    _, followed = build_sources(Training(seq_len=32, seed=3), Validation(enable=True), BYTES)  # the default
    assert torch.equal(followed.windows(idx), v)


def llama3_layout() -> Tokenizer:
    """A tokenizer laid out as Llama 3's (128000 ranks, then its 256 special ids), without its file."""
    ranks = {bytes([i]): i for i in range(256)}
    ranks |= {i.to_bytes(3, "little"): i for i in range(256, LLAMA3_N_RANKS)}
    return Tokenizer("llama3_layout", ranks, LLAMA3_SPECIALS)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe", "llama3"])
def test_synthetic_windows_hold_no_special_id(tokenizer):
    """Special ids (BOS among them: a document's start to block_causal) are the tokenizer's last; synthetic data
    draws from every regular id and never from them."""
    tok = {"bytes": BYTES, "bpe": BPE}.get(tokenizer) or llama3_layout()
    specials = torch.tensor(sorted(tok.special_tokens.values()))
    assert specials.min() == len(tok.ranks) and specials.max() == tok.n_words - 1
    for split in ("train", "validation"):
        windows = build_source("synthetic", "", 64, tok, seed=3, split=split).windows(torch.arange(2000))
        assert not torch.isin(windows, specials).any()
        assert windows.min() == 0 and windows.max() >= 0.99 * (len(tok.ranks) - 1)  # and the regular ids, all of them


def test_python_stdlib_holds_out_every_50th_file_for_validation():
    train = datasets.corpus_files("python_stdlib", "", "train", "k")
    val = datasets.corpus_files("python_stdlib", "", "validation", "k")
    assert val and not set(train) & set(val)
    assert sorted(train + val) == datasets.stdlib_files()
    source = build_source("python_stdlib", "", 64, BYTES, seed=0, split="validation")
    text = BYTES.decode(source.windows(torch.arange(source.n)).flatten().tolist())
    assert "def " in text or "import " in text


def windows_of(source, n: int) -> set[int]:
    """The stream windows of an arange_source that global positions [0, n) read, by their first token."""
    return set((source.windows(torch.arange(n))[:, 0] // source.length).tolist())


def test_a_resume_with_another_seed_is_refused():
    """The seed keys each epoch's permutation: a run saved half way through an epoch of 400 windows and resumed under
    another seed would read the rest of another permutation, training some windows twice and others never."""
    loader = DataLoader(arange_source(400 * 10, 9), 8, 2, 0, 1)
    for _ in range(25):  # 200 of the 400 windows
        loader.next_batch()
    state = loader.state_dict()
    trained = windows_of(arange_source(400 * 10, 9), 200)
    reseeded = arange_source(400 * 10, 9, seed=1)
    rest = set((reseeded.windows(torch.arange(200, 400))[:, 0] // 10).tolist())
    twice, never = trained & rest, set(range(400)) - trained - rest
    assert len(twice) == len(never) > 50, (len(twice), len(never))  # what the refusal prevents
    with pytest.raises(ConfigError, match=r"^the checkpoint was trained with training.seed 0 and this run has 1: the "
                                          r"seed keys the data order, .* resume with --training.seed 0, or start a "
                                          r"new run in another dump folder$"):
        DataLoader(reseeded, 8, 2, 0, 1).load_state_dict(state)
    DataLoader(arange_source(400 * 10, 9), 8, 2, 0, 1).load_state_dict(state)  # the same seed resumes
    # Saved before the digest held the seed: nothing to compare, the resume goes on as it did.
    was = json.loads(state["digest"])
    del was["seed"]
    DataLoader(reseeded, 8, 2, 0, 1).load_state_dict({**state, "digest": json.dumps(was, sort_keys=True)})
    synthetic = DataLoader(SyntheticSource(16, 256, 3), 8, 2, 0, 1)
    synthetic.next_batch()
    with pytest.raises(ConfigError, match="training.seed 3 and this run has 4"):
        DataLoader(SyntheticSource(16, 256, 4), 8, 2, 0, 1).load_state_dict(synthetic.state_dict())


@pytest.mark.parametrize("seed", [0, 1])
def test_validation_following_the_files_holds_out_every_50th_window(seed):
    seq_len, total = 9, 10 * 230 + 3  # 230 windows: 4 held out (49, 99, 149, 199), 226 to train on
    train, val = arange_source(total, seq_len, cuts=(500,), seed=seed).hold_out()
    assert (train.n, val.n) == (226, 4)
    held_out = {49, 99, 149, 199}
    assert windows_of(val, 4) == held_out and windows_of(train, 226) == set(range(230)) - held_out
    # Every epoch of training, reshuffled, reads each window it may read once and never a held-out one.
    for epoch in range(3):
        w = train.windows(torch.arange(epoch * 226, (epoch + 1) * 226))
        assert len(set(w[:, 0].tolist())) == 226 and not held_out & set((w[:, 0] // 10).tolist())
        assert torch.equal(w[:, 1:] - w[:, :-1], torch.ones(226, seq_len, dtype=torch.long))  # whole windows


@pytest.mark.parametrize("dp", [2, 4])
def test_held_out_split_is_the_same_on_every_data_parallel_degree(dp):
    train, val = arange_source(10 * 230, 9).hold_out()
    for source in (train, val):
        ref, _ = global_batches(source, 1, 60)
        got, _ = global_batches(source, dp, 60)
        assert all(torch.equal(ri, gi) for (ri, _), (gi, _) in zip(ref, got))
    seen = {w // 10 for inputs, _ in global_batches(train, dp, 60)[0] for w in inputs[:, 0].tolist()}
    assert seen == set(range(230)) - {49, 99, 149, 199}  # 480 windows: two epochs' worth, none held out


def sections(**validation) -> tuple[Training, Validation]:
    return Training(dataset="jsonl", seq_len=15), Validation(**validation)


def test_validation_follows_the_users_files_and_training_skips_only_then(tmp_path, corpus):
    t, _ = sections()
    t.dataset_path = corpus
    whole = build_source("jsonl", corpus, 15, BYTES, 0)
    assert whole.n >= 2 * HOLDOUT
    train, val = build_sources(t, Validation(enable=True), BYTES)
    assert (train.part, val.part, train.n + val.n) == ("train", "validation", whole.n)
    assert not set(train.order(torch.arange(train.n))) & set(val.order(torch.arange(val.n)))
    # Validation off, or on a source of its own: training reads every window in today's order.
    (tmp_path / "val").mkdir()
    other = write_jsonl(tmp_path / "val" / "other.jsonl", DOCS[::-1])
    for v in (Validation(), Validation(dataset="jsonl", dataset_path=str(other)),
              Validation(enable=True, dataset="jsonl", dataset_path=str(other))):
        source, val = build_sources(t, v, BYTES)
        idx = torch.arange(3 * whole.n)
        assert source.part == "all" and torch.equal(source.windows(idx), whole.windows(idx))
        assert (val is None) == (not v.enable)


def test_the_trainer_validates_a_run_on_the_users_files_on_their_held_out_part(tmp_path, corpus):
    cfg = load_config(["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path / "run"), "--training.seq_len",
                       "15", "--training.dataset", "jsonl", "--training.dataset_path", corpus, "--validation.enable"])
    *_, source, val_sources = train.preflight(cfg, 1)
    assert (source.part, val_sources[""].part) == ("train", "validation")
    assert val_sources[""].chunks[0] is source.chunks[0]  # the same tokens: the files are read once


def test_python_stdlib_validation_is_unchanged_every_50th_file(monkeypatch):
    """The debug config validates on the training data's held-out part, which for python_stdlib is its validation
    split, as when it named it; training reads all its training files, unsplit. (Files, not tokens: tokenizing the
    whole standard library would cost the suite seconds.)"""
    read = []
    monkeypatch.setattr(datasets, "cached_tokens", lambda files, tok: read.append(files) or torch.arange(10_000))
    cfg = load_config(["--job.config_file", str(ROOT / "train_configs/debug_model.toml")])
    assert cfg.validation.enable and cfg.validation.dataset == "" and cfg.training.dataset == "python_stdlib"
    train, val = build_sources(cfg.training, cfg.validation, BPE)
    assert read == [datasets.corpus_files("python_stdlib", "", split, "k") for split in ("train", "validation")]
    assert read[1] == datasets.stdlib_files()[HOLDOUT - 1 :: HOLDOUT]
    assert train.part == val.part == "all"


def test_validating_on_the_training_files_is_a_loud_warning(tmp_path, corpus, caplog):
    t, _ = sections()
    t.dataset_path = corpus
    (tmp_path / "val").mkdir()
    same = str(tmp_path / "val" / ".." / "a.jsonl")  # one of the training files, by another name
    warn_if_validating_on_training_data(t, Validation(enable=True, dataset="jsonl", dataset_path=same))
    assert [r.getMessage() for r in caplog.records] == [
        f"WARNING: val_loss is measured on training data: validation reads 1 file(s) that training reads too "
        f"({same}); leave validation.dataset empty to validate on a held-out part of the training data"]
    caplog.clear()
    other = write_jsonl(tmp_path / "val" / "other.jsonl", DOCS[::-1])
    for v in (Validation(enable=True), Validation(enable=True, dataset="jsonl", dataset_path=str(other)),
              Validation(dataset="jsonl", dataset_path=same)):
        warn_if_validating_on_training_data(t, v)
    assert not caplog.records


def test_bad_validation_sources_are_one_line(tmp_path, corpus, error_line):
    assert error_line(1, ["--validation.enable", "--validation.dataset_path", corpus]) == (
        "error: validation.dataset_path is set but validation.dataset is empty: name the dataset too, or clear the "
        "path to validate on a held-out part of the training data")
    (tmp_path / "short.txt").write_text("x" * 600)  # 601 tokens: 9 windows of 65, none to hold out
    assert error_line(1, ["--training.dataset", "text", "--training.dataset_path", str(tmp_path / "short.txt"),
                          "--validation.enable"]) == (
        f"error: training.dataset text ({tmp_path / 'short.txt'}) holds 9 windows of seq_len + 1 = 65 tokens, too "
        "few to hold out every 50th for validation: add data, set validation.dataset, or turn validation off")


def test_builtin_corpus_is_tokenized_once_and_shared(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_LITE_CACHE", str(tmp_path / "cache"))
    files = datasets.stdlib_files()[:40]
    direct = torch.tensor(stream([f.read_text(errors="replace") for f in files], BPE), dtype=torch.uint16)
    # Ranks starting together: one tokenizes under the lock, the others wait and map its shard.
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: datasets.cached_tokens(files, BPE), range(3)))
    assert all(torch.equal(r, direct) for r in results)
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 1
    # The next run reads the shard without tokenizing; another tokenizer or corpus gets a shard of its own.
    monkeypatch.setattr(datasets, "tokenize_documents", lambda *a: pytest.fail("tokenized again"))
    assert torch.equal(datasets.cached_tokens(files, BPE), direct)
    monkeypatch.undo()
    monkeypatch.setenv("TORCHTITAN_LITE_CACHE", str(tmp_path / "cache"))
    datasets.cached_tokens(files, BYTES)
    datasets.cached_tokens(files[:39], BPE)
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 3


def test_unwritable_cache_only_costs_time(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("TORCHTITAN_LITE_CACHE", str(tmp_path / "file" / "cache"))
    files = datasets.stdlib_files()[:5]
    expected = stream([f.read_text(errors="replace") for f in files], BYTES)
    assert datasets.cached_tokens(files, BYTES).tolist() == expected
    assert "tokenizing without the cache" in caplog.text
