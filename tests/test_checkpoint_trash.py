"""torchtitan_lite/checkpoint/trash.py: deletions leave the training path at once, and a crash in the middle of one
never leaves a folder that looks complete. The job-level proof (a delete slower than the training timeout) is
tests/multiprocess/test_checkpoint.py."""

import os
import shutil
import threading

from torchtitan_lite.checkpoint import trash as checkpoint_trash
from torchtitan_lite.checkpoint.folder import complete_checkpoints
from torchtitan_lite.checkpoint.trash import Trash


def make(folder, name):
    os.makedirs(folder / name)
    for shard in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        (folder / name / shard).write_bytes(b"x")


def test_discard_returns_at_once_and_deletes_in_the_background(tmp_path, monkeypatch):
    make(tmp_path, "step-2")
    make(tmp_path, "step-4")
    started, release, rmtree = threading.Event(), threading.Event(), shutil.rmtree

    def slow_rmtree(path, *args, **kwargs):  # a delete that lasts until the test lets it end
        started.set()
        release.wait(timeout=30)
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_trash.shutil, "rmtree", slow_rmtree)
    trash = Trash()
    trash.discard(str(tmp_path / "step-2"))
    assert started.wait(timeout=30)  # the delete is under way, and discard has returned
    assert list(complete_checkpoints(str(tmp_path))) == [4]  # gone from view at once
    [moved] = [p for p in os.listdir(tmp_path) if p != "step-4"]
    assert moved.startswith("step-2.") and moved.endswith(".trash") and os.listdir(tmp_path / moved)
    release.set()
    trash.wait()
    assert os.listdir(tmp_path) == ["step-4"]


def test_a_crash_mid_delete_leaves_no_complete_looking_folder_and_the_next_sweep_ends_it(tmp_path, monkeypatch):
    make(tmp_path, "step-2")
    make(tmp_path, "step-4")

    def killed_rmtree(path, *args, **kwargs):  # the worst order: the shards go first, .metadata stays
        for name in os.listdir(path):
            if name != ".metadata":
                os.remove(os.path.join(path, name))
        raise OSError("killed")

    with monkeypatch.context() as m:
        m.setattr(checkpoint_trash.shutil, "rmtree", killed_rmtree)
        trash = Trash()
        trash.discard(str(tmp_path / "step-2"))
        trash.wait()
    assert list(complete_checkpoints(str(tmp_path))) == [4]
    fresh = Trash()  # the next run's first save
    fresh.sweep(str(tmp_path))
    fresh.wait()
    assert os.listdir(tmp_path) == ["step-4"]


def test_sweep_discards_what_earlier_processes_left_and_nothing_else(tmp_path):
    for name in ("step-2", "step-4.tmp", "step-6.trash", "step-8.0a1b2c3d.trash", "step-9"):
        make(tmp_path, name)
    (tmp_path / "notes.trash").write_text("not ours")
    trash = Trash()
    trash.sweep(str(tmp_path))
    trash.wait()
    assert sorted(os.listdir(tmp_path)) == ["notes.trash", "step-2", "step-9"]
