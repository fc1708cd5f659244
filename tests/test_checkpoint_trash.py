"""torchtitan_lite/checkpoint/trash.py: deletions leave the training path at once, a crash in the middle of one
never leaves a folder that looks complete, and a crash in the middle of a publish never loses both copies of a step.
The job-level proofs (a delete slower than the training timeout, a resume from an unfinished publish) are in
tests/multiprocess/test_checkpoint.py."""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from torchtitan_lite.checkpoint import trash as checkpoint_trash
from torchtitan_lite.checkpoint.folder import complete_checkpoints
from torchtitan_lite.checkpoint.trash import Trash, finish_publishing


def make(folder, name, metadata=True):
    os.makedirs(folder / name)
    for shard in ("__0_0.distcp", "__1_0.distcp", ".metadata")[:None if metadata else -1]:
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
    for name in ("step-2", "step-6.trash", "step-8.0a1b2c3d.trash", "step-9"):
        make(tmp_path, name)
    make(tmp_path, "step-4.tmp", metadata=False)  # a save still being written (a complete one is published: below)
    (tmp_path / "notes.trash").write_text("not ours")
    trash = Trash()
    trash.sweep(str(tmp_path))
    trash.wait()
    assert sorted(os.listdir(tmp_path)) == ["notes.trash", "step-2", "step-9"]


# ---- Publishing: a crash at any moment of a re-save leaves a complete step N, the new one once the old is moved aside

ROOT = Path(__file__).resolve().parents[1]
# Runs trash.publish in a process of its own that SIGKILLs itself before its filesystem operation number argv[2]
# (0: the old step-N moved aside, 1: step-N.tmp renamed into place, 2: the folder's fsync), as a node failure would.
CRASH = """
import os, signal, sys
from torchtitan_lite.checkpoint import trash
done, die_before = [], int(sys.argv[2])
def killed(op):
    def run(*args):
        if len(done) == die_before:
            os.kill(os.getpid(), signal.SIGKILL)
        done.append(op)
        return op(*args)
    return run
os.rename, os.fsync = killed(os.rename), killed(os.fsync)
trash.publish(sys.argv[1], trash.Trash())
"""


def save_of(folder, name, contents):
    make(folder, name)
    (folder / name / "__0_0.distcp").write_text(contents)


def contents(path):
    return (Path(path) / "__0_0.distcp").read_text()


@pytest.mark.parametrize("die_before, kept", [(0, "old"), (1, "new"), (2, "new")])
def test_a_crash_during_a_re_save_leaves_a_complete_step_that_the_next_run_publishes(tmp_path, die_before, kept):
    save_of(tmp_path, "step-2", "step 2")
    save_of(tmp_path, "step-4", "old")
    save_of(tmp_path, "step-4.tmp", "new")  # every rank wrote it, .metadata last
    proc = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path / "step-4.tmp"), str(die_before)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if die_before == 1:  # between the two renames: the old copy in the trash, the new one under its temporary name
        step_2, trashed, tmp = sorted(os.listdir(tmp_path))
        assert re.fullmatch(r"step-4\.[0-9a-f]{8}\.trash", trashed) and tmp == "step-4.tmp"
        assert contents(tmp_path / trashed) == "old"
    # A read-only listing (train.py --check, the tools) finds step 4 complete, with what the next run will load.
    found = complete_checkpoints(str(tmp_path))
    assert list(found) == [2, 4] and contents(found[4]) == kept
    # The next run: rank 0 at load, then the sweep of its first save; nothing else is left.
    trash = Trash()
    finish_publishing(str(tmp_path), trash)
    assert contents(complete_checkpoints(str(tmp_path))[4]) == kept
    trash.sweep(str(tmp_path))
    trash.wait()
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-4"] and contents(tmp_path / "step-4") == kept


def test_the_sweep_publishes_what_it_would_have_deleted(tmp_path):
    """The next save's sweep alone (a run that loaded nothing first) completes an unfinished publish too, and a save
    that never wrote its .metadata, or that a complete step-N supersedes, still goes."""
    save_of(tmp_path, "step-4.0a1b2c3d.trash", "old")
    save_of(tmp_path, "step-4.tmp", "new")
    save_of(tmp_path, "step-6", "step 6")
    save_of(tmp_path, "step-6.tmp", "superseded")
    make(tmp_path, "step-8.tmp", metadata=False)  # a save still being written when its process died
    trash = Trash()
    trash.sweep(str(tmp_path))
    trash.wait()
    assert sorted(os.listdir(tmp_path)) == ["step-4", "step-6"]
    assert contents(tmp_path / "step-4") == "new" and contents(tmp_path / "step-6") == "step 6"
