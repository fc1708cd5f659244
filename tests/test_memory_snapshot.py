"""The GPU's memory snapshots and allocator fields, with the device module stubbed: this CPU build has the calls but
no device behind them (what only a GPU can show: README, "What only GPUs can show")."""

import contextlib
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist

from launch import TINY, TINY_VOCAB
from torchtitan_lite.config import load_config
from torchtitan_lite.models.llama3.model import Transformer
from torchtitan_lite.models.registry import get
from torchtitan_lite.parallel.pipeline import Pipeline, split_stages
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


@pytest.fixture
def pipeline():
    """A one-stage pipeline of the tests' model on a one-process gloo group, run by torch's schedule
    (parallel/pipeline.py), that has trained one step: the stage's shape inference is done."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = load_config(["--job.config_file", str(TINY)])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        [part] = split_stages(Transformer, get("llama3").args("tiny", TINY_VOCAB, 64), 0, cfg.parallelism)
        part.to_empty(device="cpu").init_weights()
        pipe = Pipeline([part], init_device_mesh("cpu", (1,), mesh_dim_names=("pp",)), torch.device("cpu"), cfg,
                        lambda logits, labels, tokens: logits.sum(), torch.Tensor.detach, lambda loss: loss)
        tokens = torch.randint(0, TINY_VOCAB, (2, 65))
        step = partial(pipe.forward_backward, tokens[:, :-1], tokens[:, 1:], {}, tokens.numel())
        step()
        yield part, step
    finally:
        dist.destroy_process_group()


def out_of_memory(*args):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\n(many lines)")


def out_of_memory_in_backward(module, args, output):
    output.register_hook(out_of_memory)  # the forward's output unchanged


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_out_of_memory_under_pipeline_parallelism_writes_a_snapshot_and_one_line(tmp_path, cuda_memory, pipeline,
                                                                                   where):
    """torch's pipelining raises a RuntimeError from a stage's error (after the first step's shape inference), in its
    forward as in its backward: the out-of-memory error underneath is found and said as without PP."""
    part, step = pipeline
    block = part.layers["1"]
    if where == "forward":
        block.forward = out_of_memory
    else:
        block.register_forward_hook(out_of_memory_in_backward)
    with pytest.raises(OutOfMemory) as error, contextlib.ExitStack() as exits:
        exits.enter_context(snapshots(tmp_path)).step(1)
        step()
    wrapped = error.value.__context__  # what reached the snapshots' exit
    assert type(wrapped) is RuntimeError and isinstance(wrapped.__cause__, torch.OutOfMemoryError)
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
