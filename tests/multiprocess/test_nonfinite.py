"""A NaN loss on one rank stops the whole job before the update, naming the step (at the next logging step or
checkpoint save: the decision stays on the device until then), and leaves only finite checkpoints; with
training.skip_nonfinite_steps the update is skipped and counted instead.

The NaN comes from rank 1's loss alone (nan_loss.py): the gradient reduce-scatter spreads it to every rank's
gradients, so the global gradient norm every rank checks is NaN on all of them, and they stop (or skip) together.
Both runs are one job (several_runs.py), the skipping one first: the stopping one ends it.
"""

import math
from pathlib import Path

import pytest
import torch

from launch import CHECKPOINTED, COMMON, PP2, assert_one_error_line, ckpt, read_metrics, torchrun_several
from torchtitan_lite.checkpoint.folder import complete_checkpoints
from torchtitan_lite.checkpoint.reader import read_tensors

SHIM = Path(__file__).parent / "nan_loss.py"
RUN = (*COMMON, "--training.steps", "6", *CHECKPOINTED)


def assert_checkpoints_finite(folder: Path) -> None:
    for path in complete_checkpoints(str(folder / "checkpoint")).values():
        for key, t in read_tensors(path).items():
            assert not t.is_floating_point() or torch.isfinite(t).all(), f"{path}: {key}"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(the folder holding both runs, the job's output): rank 1's loss NaN at steps 3 and 5 of each."""
    root = tmp_path_factory.mktemp("nan")
    proc = torchrun_several(2, [(root / "skipped", False, (*RUN, *PP2, "--training.skip_nonfinite_steps", "1")),
                                (root / "stopped", False, (*RUN, "--metrics.log_freq", "5"))],
                            script=SHIM, script_args=("1", "3,5"), check=False)
    return root, proc


def test_nan_loss_stops_the_job_before_the_update(job):
    """Logging every 5 steps: the host learns of step 3 at step 4's checkpoint save, which it refuses; step 4's
    update was skipped on the device, so the weights never left step 2's."""
    root, proc = job
    folder = root / "stopped"
    assert_one_error_line(proc, "step 3: the gradient norm is nan")
    assert proc.returncode != 0
    assert [m["step"] for m in read_metrics(folder)] == [1]
    assert list(complete_checkpoints(str(folder / "checkpoint"))) == [2]
    assert not (folder / "checkpoint" / "step-4.tmp").exists()
    assert_checkpoints_finite(folder)


def test_nan_steps_are_skipped_and_counted_when_allowed(job):
    """On a 2-stage pipeline: rank 1 holds the last stage and computes the NaN loss, whose gradient reaches rank 0's
    stage through the pipeline's sends; both skip the update."""
    folder = job[0] / "skipped"
    m = read_metrics(folder)
    assert [r["skipped_steps"] for r in m] == [0, 0, 1, 1, 2, 2]
    assert [math.isfinite(r["grad_norm"]) for r in m] == [True, True, False, True, False, True]
    assert ckpt(folder, 6).exists()
    assert_checkpoints_finite(folder)
