"""The GPU's memory snapshots and allocator fields, with the device module stubbed: this CPU build has the calls but
no device behind them (what only a GPU can show: README, "What only GPUs can show")."""

import contextlib

import pytest
import torch

from torchtitan_lite.config import load_config
from torchtitan_lite.runtime.memory_snapshot import MemorySnapshots, OutOfMemory
from torchtitan_lite.runtime.metrics import allocator_fields

CUDA = torch.device("cuda", 0)


@pytest.fixture
def cuda_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: calls.append(("record", enabled, kw.get("max_entries"))))

    def dump(path):
        calls.append(("dump", path))
        open(path, "wb").close()

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    return calls


def snapshots(tmp_path, *overrides):
    cfg = load_config(["--profiling.profile_freq", "2", *overrides])
    return MemorySnapshots(cfg.profiling, str(tmp_path), 3, CUDA, "train_configs/debug_model.toml")


def test_snapshots_every_profile_freq_steps_while_recording_history(tmp_path, cuda_memory):
    with snapshots(tmp_path, "--profiling.enable_memory_snapshot") as s:
        for step in range(1, 6):
            s.step(step)
    folder = tmp_path / "memory_snapshot"
    assert cuda_memory == [("record", "all", 100_000),
                           ("dump", str(folder / "iteration_2" / "rank3_memory_snapshot.pickle")),
                           ("dump", str(folder / "iteration_4" / "rank3_memory_snapshot.pickle")),
                           ("record", None, None)]  # history off again at the end


def test_an_out_of_memory_step_writes_a_snapshot_and_one_line_naming_it(tmp_path, cuda_memory):
    with pytest.raises(OutOfMemory) as error, contextlib.ExitStack() as exits:  # as train.py enters it
        s = exits.enter_context(snapshots(tmp_path))  # snapshots off: the OOM still writes one
        s.step(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\n(many lines)")
    path = tmp_path / "memory_snapshot" / "iteration_2_exit" / "rank3_memory_snapshot.pickle"
    assert cuda_memory == [("dump", str(path))] and path.exists()
    line = str(error.value)
    assert "\n" not in line and str(path) in line and "scripts/estimate_memory.py" in line and "step 2" in line


def test_other_errors_and_the_cpu_write_no_snapshot(tmp_path, cuda_memory):
    with pytest.raises(ValueError), snapshots(tmp_path):
        raise ValueError("not memory")
    cfg = load_config(["--profiling.enable_memory_snapshot"])
    with MemorySnapshots(cfg.profiling, str(tmp_path), 0, torch.device("cpu"), "") as s:
        s.step(10)
    assert cuda_memory == []


def test_allocator_fields_on_a_gpu_only(monkeypatch):
    stats = {"reserved_bytes.all.peak": 3 * 2**30, "num_alloc_retries": 2, "num_ooms": 1}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: stats)
    assert allocator_fields(CUDA) == {"max_reserved_gib": 3.0, "alloc_retries": 2, "ooms": 1}
    assert allocator_fields(torch.device("cpu")) == {}
