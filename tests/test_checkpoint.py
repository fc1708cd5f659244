"""torchtitan_lite/checkpoint/manager.py in one process: the folder rules, safe reading, and the small Stateful pieces.
The multi-process behaviour (resume, reshard, atomic saves) is in tests/multiprocess/test_checkpoint.py."""

import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # DCP wraps errors in this BaseException

import train
from tests.multiprocess.launch import ROOT, TINY
from torchtitan_lite.checkpoint.folder import complete_checkpoints, steps_to_delete
from torchtitan_lite.checkpoint.manager import TrainState, check_config
from torchtitan_lite.checkpoint.reader import SafePlanner, SafeReader, read_metadata, read_tensors
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
    for name in ("step-1.trash", "step-3.old", "notes", "step-x"):
        make(tmp_path, name)  # being deleted, or not ours: never a checkpoint, .metadata or not
    make(tmp_path, "step-14.tmp", metadata=False)  # a save in progress
    make(tmp_path, "step-10.tmp")  # complete, but step-10 is too: the published one counts
    make(tmp_path, "step-12.tmp")  # complete and never renamed into place: step 12 (trash.finish_publishing)
    (tmp_path / "step-7").write_text("a file, not a folder")
    found = complete_checkpoints(str(tmp_path))
    assert list(found) == [0, 2, 10, 12]  # oldest first, numerically (10 after 2)
    assert found[10] == str(tmp_path / "step-10") and found[12] == str(tmp_path / "step-12.tmp")
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


def passes_check(monkeypatch, dump_folder, *overrides: str) -> bool:
    """Whether `WORLD_SIZE=1 train.py --check` of the tests' config with `overrides` accepts it."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    return train.run(["--job.config_file", str(TINY), "--job.dump_folder", str(dump_folder), *overrides],
                     check=True) == 0


def test_check_refuses_a_load_step_without_its_checkpoint(tmp_path, error_line, monkeypatch):
    """`train.py --check` knows from the folder what the run's load would refuse after torchrun started every rank."""
    folder = tmp_path / "checkpoint"
    make(folder, "step-2")
    make(folder, "step-4")
    make(folder, "step-6", metadata=False)  # a save that never finished
    line = error_line(4, ["--checkpoint.enable", "--checkpoint.load_step", "6"])
    assert line == (f"error: checkpoint.load_step 6: {folder}/step-6 is not a complete checkpoint (complete ones: "
                    "step-2, step-4)")
    assert passes_check(monkeypatch, tmp_path, "--checkpoint.enable", "--checkpoint.load_step", "4")
    assert passes_check(monkeypatch, tmp_path, "--checkpoint.enable", "--checkpoint.load_step", "6",
                        "--checkpoint.create_seed_checkpoint")  # a seed run loads nothing
    make(folder, "step-8.tmp")  # complete and never published: the run publishes it at load, --check only reads it
    assert passes_check(monkeypatch, tmp_path, "--checkpoint.enable", "--checkpoint.load_step", "8")
    assert sorted(os.listdir(folder)) == ["step-2", "step-4", "step-6", "step-8.tmp"]


def test_check_refuses_an_initial_load_path_only_when_the_run_would_use_it(tmp_path, error_line, monkeypatch):
    missing, partial = tmp_path / "elsewhere" / "step-5", tmp_path / "elsewhere" / "step-3"
    make(tmp_path / "elsewhere", "step-3", metadata=False)
    for path, why in ((missing, "does not exist"), (partial, "has no .metadata (not a complete DCP checkpoint)")):
        # Used with or without checkpoint.enable while the run's own folder holds no checkpoint.
        for enable in ("--checkpoint.enable", "--no-checkpoint.enable"):
            line = error_line(1, [enable, "--checkpoint.initial_load_path", str(path)])
            assert line == f"error: checkpoint.initial_load_path {path} {why}"
    make(tmp_path / "checkpoint", "step-2")  # the run resumes from its own checkpoint and never reads the path
    assert passes_check(monkeypatch, tmp_path, "--checkpoint.enable", "--checkpoint.initial_load_path", str(missing))


def test_check_command_exits_2_with_one_line(tmp_path):
    """What run_train.sh runs before torchrun, as a process of its own."""
    make(tmp_path / "checkpoint", "step-2")
    proc = subprocess.run([sys.executable, "train.py", "--check", "--job.config_file", str(TINY), "--job.dump_folder",
                           str(tmp_path), "--checkpoint.enable", "--checkpoint.load_step", "3"],
                          cwd=ROOT, env={**os.environ, "WORLD_SIZE": "4"}, capture_output=True, text=True)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [f"error: checkpoint.load_step 3: {tmp_path}/checkpoint/step-3 is not a "
                                        "complete checkpoint (complete ones: step-2)"]
