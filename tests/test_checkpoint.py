"""torchtitan_lite/checkpoint.py in one process: the folder rules, safe reading, and the small Stateful pieces.
The multi-process behaviour (resume, reshard, atomic saves) is in tests/multiprocess/test_checkpoint.py."""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # DCP wraps errors in this BaseException

from torchtitan_lite.checkpoint import (
    TrainState,
    check_config,
    complete_checkpoints,
    steps_to_delete,
)
from torchtitan_lite.checkpoint_reader import SafePlanner, SafeReader, read_metadata, read_tensors
from torchtitan_lite.config import Checkpoint, ConfigError


def make(folder, name, metadata=True):
    os.makedirs(folder / name)
    (folder / name / "__0_0.distcp").write_bytes(b"")
    if metadata:
        (folder / name / ".metadata").write_bytes(b"")


def save(path, state):
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def test_complete_checkpoints_are_step_folders_with_metadata(tmp_path):
    for name in ("step-2", "step-10", "step-0"):
        make(tmp_path, name)
    make(tmp_path, "step-99", metadata=False)  # a save that never finished
    for name in ("step-12.tmp", "step-1.trash", "step-3.old", "notes", "step-x"):
        make(tmp_path, name)  # in progress, being deleted, or not ours: never a checkpoint, .metadata or not
    (tmp_path / "step-7").write_text("a file, not a folder")
    found = complete_checkpoints(str(tmp_path))
    assert list(found) == [0, 2, 10]  # oldest first, numerically (10 after 2)
    assert found[10] == str(tmp_path / "step-10")
    assert complete_checkpoints(str(tmp_path / "absent")) == {}


@pytest.mark.parametrize("steps, k, just_saved, expected", [
    ([2, 4, 6, 8], 0, 8, []),  # 0 keeps everything
    ([2, 4, 6, 8], 2, 8, [2, 4]),
    ([8, 2, 6, 4], 1, 8, [2, 4, 6]),  # order of the listing does not matter
    ([2, 4], 3, 4, []),
    ([2, 12, 20], 1, 12, [2]),  # resumed from an older step: the one just saved is kept, the newest too
    ([6], 1, 6, []),
])
def test_keep_latest_k_never_deletes_the_checkpoint_just_saved(steps, k, just_saved, expected):
    assert steps_to_delete(steps, k, just_saved) == expected


def test_read_tensors_gives_full_plain_tensors(tmp_path):
    state = {"model": {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.bfloat16)}, "other": {"n": 3}}
    save(tmp_path / "c", state)
    tensors = read_tensors(str(tmp_path / "c"))
    assert tensors.keys() == {"model.w", "model.b"}
    assert torch.equal(tensors["model.w"], state["model"]["w"]) and tensors["model.b"].dtype == torch.bfloat16
    assert tuple(read_metadata(str(tmp_path / "c")).state_dict_metadata["model.w"].size) == (3, 4)


class Exploit:
    """What a crafted checkpoint could hold: an object whose unpickling runs code (here: creates a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_metadata_cannot_run_code(tmp_path):
    save(tmp_path / "c", {"w": torch.zeros(2)})
    marker = tmp_path / "pwned"
    with open(tmp_path / "c" / ".metadata", "wb") as f:
        pickle.dump(Exploit(str(marker)), f)
    with pytest.raises(ConfigError, match="(io|builtins).open is not allowed in checkpoint metadata"):
        read_metadata(str(tmp_path / "c"))
    with pytest.raises(CheckpointException, match="io.open is not allowed in checkpoint metadata"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=SafeReader(str(tmp_path / "c")), no_dist=True)
    assert not marker.exists()


def test_non_tensor_values_cannot_run_code(tmp_path):
    marker = tmp_path / "pwned"
    save(tmp_path / "c", {"train_state": {"step": Exploit(str(marker))}})
    state = {"train_state": {"step": 0}}
    with pytest.raises(CheckpointException, match="Weights only load failed"):
        dcp.load(state, storage_reader=SafeReader(str(tmp_path / "c")), planner=SafePlanner(), no_dist=True)
    assert not marker.exists()
    save(tmp_path / "ok", {"train_state": {"step": 7, "lr": [1e-3], "name": "x"}})  # plain data loads as usual
    state = {"train_state": {"step": 0, "lr": [0.0], "name": ""}}
    dcp.load(state, storage_reader=SafeReader(str(tmp_path / "ok")), planner=SafePlanner(), no_dist=True)
    assert state == {"train_state": {"step": 7, "lr": [1e-3], "name": "x"}}


def test_train_state_continues_elapsed_time():
    state = TrainState()
    state.step, state.tokens_seen = 10, 5120
    saved = state.state_dict()
    resumed = TrainState()
    resumed.load_state_dict({**saved, "elapsed_s": 100.0})
    assert (resumed.step, resumed.tokens_seen) == (10, 5120)
    assert 100.0 <= resumed.elapsed_s() < 101.0


def test_unwritable_folders_are_refused_at_start(tmp_path):
    check_config(Checkpoint(enable=True), 1, str(tmp_path / "run"))
    assert (tmp_path / "run" / "checkpoint").is_dir()
    (tmp_path / "file").write_text("")  # a path below a file cannot be created, even by root
    with pytest.raises(ConfigError, match="job.dump_folder: cannot write to .*file/run"):
        check_config(Checkpoint(), 1, str(tmp_path / "file" / "run"))
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "ckpt").write_text("")
    with pytest.raises(ConfigError, match="checkpoint.folder: cannot write to .*run2/ckpt"):
        check_config(Checkpoint(enable=True, folder="ckpt"), 1, str(tmp_path / "run2"))


def test_check_config():
    check_config(Checkpoint(create_seed_checkpoint=True), world_size=1)
    with pytest.raises(ConfigError, match="NGPU=1"):
        check_config(Checkpoint(create_seed_checkpoint=True), world_size=4)
    with pytest.raises(ConfigError, match="checkpoint.load_step needs checkpoint.enable"):
        check_config(Checkpoint(load_step=3), world_size=1)
