"""Every parallel layout trains the same model on the same global batch and gives the single-process loss curve, its
gradient norms, and at step 1 its every gradient.

The runs are the suite's shared runs (run_table.py): global batch 8 on every layout, each accumulating as many
micro-batches as its data-parallel degree leaves. Differences come only from the order of floating-point reductions
(TP's partial sums, the gradient reduce-scatter), so the curves agree to 1e-5, not bitwise; the same layout twice is
bitwise (tests/test_train.py, and the resume tests of test_checkpoint.py).
"""

import subprocess
import sys

import pytest

from run_table import COMPILED, CONTEXT_PARALLEL, PIPELINED, SHARED_RUNS
from grad_dump import assert_grads_match, load_grads
from launch import ROOT, STEPS, assert_same_curve, losses

pytestmark = [pytest.mark.reads("shared_2p"), pytest.mark.starts_with_session(4)]  # reads every 4-process run

TOLERANCE = 1e-5


def test_single_process_with_accumulation_learns(runs):
    curve = losses(runs["single"])
    assert sorted(curve) == list(range(1, STEPS + 1))
    assert curve[STEPS] < curve[1] - 1.0


# Every shared run that has a single-process reference: a new model's runs join with theirs (run_table.py).
COMPARED = [name for name, run in SHARED_RUNS.items() if run.reference is not None]


@pytest.mark.parametrize("layout", COMPARED)
def test_layout_matches_single_process_through_loss_compare(runs, layout):
    single, folder = runs[SHARED_RUNS[layout].reference], runs[layout]
    curve = losses(folder)
    assert sorted(curve) == list(range(1, len(curve) + 1)) and len(curve) >= 4
    worst = assert_same_curve(folder, single, TOLERANCE)["loss"]
    # The user-facing tool agrees, and fails when asked for more than the layouts can give.
    tool = [sys.executable, str(ROOT / "scripts/loss_compare.py"), str(single), str(folder)]
    assert subprocess.run(tool + ["--tolerance", str(TOLERANCE)], capture_output=True).returncode == 0
    if worst > 0:
        assert subprocess.run(tool + ["--tolerance", "0"], capture_output=True).returncode == 1


# Pipeline, context-parallel and compiled layouts are checked beside their own tests.
@pytest.mark.parametrize("layout", [n for n in COMPARED if n not in (*COMPILED, *PIPELINED, *CONTEXT_PARALLEL)])
def test_layout_reduces_every_gradient_as_one_process(runs, eager_grads, layout):
    """Every parameter's gradient after step 1, not only the curve: a gradient reduced with the wrong factor or over
    the wrong group can hide behind a plausible loss."""
    assert_grads_match(load_grads(runs[layout]), eager_grads(layout), TOLERANCE)
