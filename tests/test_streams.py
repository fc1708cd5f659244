"""Streams: the packer's exact resume, and Hugging Face's datasets (a stand-in where `datasets` is not installed)."""

import copy
import itertools
import sys
import types

import pytest
import torch

from tests.test_data import BYTES, DOCS, bad, global_batches, write_jsonl
from torchtitan_lite.data.loader import HFSource, Packer, build_source

class ListStream:
    """A streaming source over a list of documents, sharded by rank like the hf source."""

    streaming = True

    def __init__(self, docs: list[str], seq_len: int):
        self.docs, self.length = docs, seq_len + 1

    def open(self, dp_rank, dp_size, docs, offset, position=""):
        shard = itertools.cycle(self.docs[dp_rank::dp_size])
        tokens = (BYTES.encode(t, bos=True, eos=True) if t else [] for t in itertools.islice(shard, docs, None))
        return Packer(tokens, self.length, docs, offset)


def test_packer_resumes_mid_document_exactly():
    docs = [list(range(100 * i, 100 * i + n)) for i, n in enumerate([5, 0, 23, 1, 40, 7, 0, 3] * 5)]
    ref = Packer(iter(docs), 11)
    windows = [ref.next_window() for _ in range(15)]
    assert torch.equal(torch.cat(windows), torch.tensor([t for d in docs for t in d][: 15 * 11]))
    for k in range(1, 15):
        p = Packer(iter(docs), 11)
        for _ in range(k):
            p.next_window()
        resumed = Packer(iter(docs[p.docs :]), 11, p.docs, p.offset)
        assert all(torch.equal(resumed.next_window(), w) for w in windows[k:])


def test_packer_refuses_an_offset_past_its_document():
    # A checkpoint's offset into a document that is now shorter (the dataset changed): an error, not an endless loop.
    with bad("document 4 of the stream has 3 tokens, but the checkpoint resumes at token 5"):
        Packer(iter([[1, 2, 3], [4, 5]]), 4, docs=4, offset=5).next_window()


def test_streams_resume_per_rank_and_refuse_another_dp_degree():
    source = ListStream(DOCS, 15)
    ref, _ = global_batches(source, 2, 12)
    _, loaders = global_batches(source, 2, 5)
    state = {k: v for loader in loaders for k, v in loader.state_dict().items()}  # what a checkpoint gathers
    assert state["dp_size"] == 2 and {"dp_rank_0", "dp_rank_1"} <= state.keys()
    got, _ = global_batches(source, 2, 7, state=state)
    assert all(torch.equal(r[0], g[0]) for r, g in zip(ref[5:], got))
    with bad("streamed its data on 2 data-parallel ranks.*resuming on 4"):
        global_batches(source, 4, 1, state=state)


class FakeIterableDataset:
    """datasets' streaming IterableDataset as far as a resume sees it: files (lists of rows) read in order, and
    state_dict()/load_state_dict() as datasets has them: the state counts a row before yielding it, moves to the next
    file only when asked for the row after a file's last, and a loaded state applies to every pass over the stream.
    `reads` counts the rows read: a resume inside a file reads that file's rows before the position again, as
    datasets' readers do. `stale` mimics datasets 5.0, whose state stopped advancing after a load."""

    def __init__(self, files: list[list[str]], stale: bool = False, reads: list[int] | None = None):
        self.files, self.stale, self.reads = files, stale, reads if reads is not None else [0]
        self.loaded, self.state = None, self.start()

    @staticmethod
    def start() -> dict:
        return {"examples_iterable": {"shard_idx": 0, "shard_example_idx": 0, "type": "ArrowExamplesIterable"},
                "epoch": 0}

    def split(self, rank: int, world_size: int) -> "FakeIterableDataset":  # split_dataset_by_node, by files
        return type(self)(self.files[rank::world_size], self.stale, self.reads)

    def state_dict(self) -> dict:
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state

    def __iter__(self):
        self.state = copy.deepcopy(self.loaded) if self.loaded else self.start()
        live = self.state["examples_iterable"]
        if self.stale and self.loaded:
            self.state = self.start()
        for f in range(live["shard_idx"], len(self.files)):
            for i, text in enumerate(self.files[f]):
                self.reads[0] += 1
                if i >= live["shard_example_idx"]:
                    live["shard_example_idx"] += 1
                    yield {"text": text}
            live["shard_idx"], live["shard_example_idx"] = live["shard_idx"] + 1, 0


@pytest.fixture
def fake_datasets(monkeypatch):
    """`datasets.distributed.split_dataset_by_node` for FakeIterableDataset, whether or not datasets is installed."""
    module = types.ModuleType("datasets.distributed")
    module.split_dataset_by_node = lambda dataset, rank, world_size: dataset.split(rank, world_size)
    monkeypatch.setitem(sys.modules, "datasets", types.ModuleType("datasets"))
    monkeypatch.setitem(sys.modules, "datasets.distributed", module)


class StatelessDataset(FakeIterableDataset):
    """A dataset from before datasets 2.18: no state_dict."""

    def __getattribute__(self, name: str):
        if name in ("state_dict", "load_state_dict"):
            raise AttributeError(name)
        return super().__getattribute__(name)


FILES = [DOCS[i : i + 3] for i in range(0, 24, 3)]  # 8 files of 3 documents: 4 per rank with dp 2, 24 steps >1 pass


def resumed_batches(dataset, stop: int, steps: int, keep=lambda state: state):
    """Batches of dp 2 resumed from a checkpoint after `stop` steps (its state passed through `keep`), to `steps`,
    and how many rows the resume read."""
    source = HFSource(dataset, "text", BYTES, 15)
    _, loaders = global_batches(source, 2, stop)
    state = keep({k: v for loader in loaders for k, v in loader.state_dict().items()})
    before = dataset.reads[0]
    got, loaders = global_batches(source, 2, steps - stop, state=state)
    return got, dataset.reads[0] - before, loaders


# In the first file; rank 1 after a file's last document, then after the pass's last; both ranks in the second pass.
@pytest.mark.parametrize("stop", [3, 12, 18, 21])
def test_hf_stream_resumes_from_its_own_state_exactly_without_rereading(fake_datasets, stop):
    ref, _ = global_batches(HFSource(FakeIterableDataset(FILES), "text", BYTES, 15), 2, 24)
    dataset = FakeIterableDataset(FILES)
    got, reads, _ = resumed_batches(dataset, stop, 24)
    assert all(torch.equal(r[0], g[0]) for r, g in zip(ref[stop:], got))
    counted, counted_reads, _ = resumed_batches(FakeIterableDataset(FILES), stop, 24, keep=lambda state: {
        k: {**v, "stream": ""} if k.startswith("dp_rank_") else v for k, v in state.items()})  # an older checkpoint
    assert all(torch.equal(r[0], g[0]) for r, g in zip(ref[stop:], counted))
    assert (reads < counted_reads) == (stop > 3)  # the files before the position are not read again


def test_hf_stream_counts_documents_where_the_state_is_missing_or_stale(fake_datasets):
    ref, _ = global_batches(HFSource(FakeIterableDataset(FILES), "text", BYTES, 15), 2, 24)
    got, _, _ = resumed_batches(StatelessDataset(FILES), 5, 24)
    assert all(torch.equal(r[0], g[0]) for r, g in zip(ref[5:], got))
    # A stale state resumes right once, then would restart the stream: its checkpoints count documents instead.
    stale = FakeIterableDataset(FILES, stale=True)
    source = HFSource(stale, "text", BYTES, 15)
    _, loaders = global_batches(source, 2, 5)
    state = {k: v for loader in loaders for k, v in loader.state_dict().items()}
    got, loaders = global_batches(source, 2, 5, state=state)
    assert all(torch.equal(r[0], g[0]) for r, g in zip(ref[5:10], got))
    again = {k: v for loader in loaders for k, v in loader.state_dict().items()}
    assert again["dp_rank_0"]["stream"] == "" and again["dp_rank_0"]["docs"] > 0
    got, _ = global_batches(source, 2, 14, state=again)
    assert all(torch.equal(r[0], g[0]) for r, g in zip(ref[10:], got))


def test_hf_needs_the_datasets_package():
    try:
        import datasets as hf_datasets  # noqa: F401
    except ImportError:
        with bad("needs the optional `datasets` package"):
            build_source("hf", "allenai/c4:en", 8, BYTES, 0)
    else:
        pytest.skip("datasets is installed")


def test_hf_streams_a_local_dataset_offline(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "hf"
    folder.mkdir()
    write_jsonl(folder / "part0.jsonl", DOCS[:30])
    write_jsonl(folder / "part1.jsonl", DOCS[30:])
    source = build_source("hf", str(folder), 15, BYTES, 0)
    ref, _ = global_batches(source, 2, 10)
    seen = torch.cat([i for i, _ in ref]).flatten().tolist()
    assert "document" in BYTES.decode([t for t in seen if t < 256])
    _, loaders = global_batches(source, 2, 4)
    state = {k: v for loader in loaders for k, v in loader.state_dict().items()}
    got, _ = global_batches(source, 2, 6, state=state)
    assert all(torch.equal(r[0], g[0]) for r, g in zip(ref[4:], got))
    with bad("resuming on 1"):
        global_batches(source, 1, 1, state=state)
    with bad("cannot stream"):
        build_source("hf", str(tmp_path / "missing"), 15, BYTES, 0)
    with bad("no string field 'body' .*text, id"):
        build_source("hf", str(folder), 15, BYTES, 0, text_field="body")
