"""A disk that fills up during a save: the job stops with one line naming the step, the rank and the cause, the
half-written checkpoint is gone, and the previous one is intact and resumes; with checkpoint.continue_on_save_error
the run trains on and saves again once there is room."""

import re
from pathlib import Path

import pytest
from launch import (
    CHECKPOINTED,
    COMMON,
    ROOT,
    assert_one_error_line,
    ckpt,
    error_lines,
    losses,
    read_metrics,
    torchrun,
    train_in_process,
)

from torchtitan_lite.checkpoint.folder import complete_checkpoints

FULL_DISK = ROOT / "tests" / "multiprocess" / "full_disk.py"


def test_full_disk_stops_the_run_and_the_previous_checkpoint_resumes(tmp_path):
    run = torchrun(2, tmp_path, *COMMON, "--training.steps", "6", *CHECKPOINTED, script=FULL_DISK,
                   script_args=("1", "4"), check=False)
    assert_one_error_line(run, "saving checkpoint step-4 failed on rank 1 (")
    assert "GiB free in" in error_lines(run, "")[0] and "step-2 is intact" in error_lines(run, "")[0]
    assert list(complete_checkpoints(str(tmp_path / "checkpoint"))) == [2]
    assert sorted(p.name for p in Path(tmp_path / "checkpoint").iterdir()) == ["step-2"]  # no step-4.tmp left
    before = losses(tmp_path)
    assert sorted(before) == [1, 2, 3, 4]  # step 4 trained and logged; its save failed

    resumed = train_in_process(tmp_path, *COMMON, "--training.steps", "4", *CHECKPOINTED)
    assert f"loaded full state from {ckpt(tmp_path, 2)}" in resumed.stdout
    assert losses(tmp_path) == pytest.approx(before, abs=1e-5, rel=0)  # 1 process now, 2 before: same curve


def test_with_continue_on_save_error_the_run_trains_on_and_saves_again(tmp_path):
    run = torchrun(2, tmp_path, *COMMON, "--training.steps", "6", *CHECKPOINTED, "--checkpoint.continue_on_save_error",
                   script=FULL_DISK, script_args=("1", "4", "free"))
    assert "saving checkpoint step-4 failed on rank 1" in run.stdout + run.stderr and "training goes on" in run.stderr
    assert list(complete_checkpoints(str(tmp_path / "checkpoint"))) == [2, 6]
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_a_failed_async_save_stops_every_rank_after_the_same_step(tmp_path):
    # Rank 1 sees its save of step 4 end one check later than rank 0 does: they still agree on when to stop.
    run = torchrun(2, tmp_path, *COMMON, "--training.steps", "8", *CHECKPOINTED, "--checkpoint.async_mode", "async",
                   script=FULL_DISK, script_args=("1", "4", "late"), check=False)
    assert_one_error_line(run, "saving checkpoint step-4 failed on rank 1 (")
    learned = dict(re.findall(r"rank (\d) learned of the failure after step (\d+)", run.stdout + run.stderr))
    assert learned.keys() == {"0", "1"} and len(set(learned.values())) == 1, (run.stdout + run.stderr)[-3000:]
    assert sorted(p.name for p in Path(tmp_path / "checkpoint").iterdir()) == ["step-2"]
