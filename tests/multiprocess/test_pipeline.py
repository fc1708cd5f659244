"""Pipeline parallelism trains the single-process model exactly: the same curve, the same gradient for every
parameter, true numbers in the log whichever stage the logging rank holds, and checkpoints that know no layout.

The runs are the suite's shared pipeline runs (run_table.py), one per schedule: GPipe with accumulation, 1F1B beside
FSDP 2, LoopedBFS beside TP 2 with every block recomputed, and Interleaved1F1B with compiled blocks, with 2 stages per
rank for the last two. Their loss curves are in
the layout matrix of test_layouts.py; here, what a curve could hide. Tolerance 1e-5 as there: a micro-batch's matmuls
and the gradient sums over micro-batches round in another order than one batch's, nothing more.
"""

import os

import pytest
import torch

from run_table import PIPELINED, SHARED_RUNS
from grad_dump import assert_grads_match, load_grads
from launch import assert_same_curve, ckpt, curve, read_metrics
from test_checkpoint import assert_continues, assert_same_state

from torchtitan_lite.checkpoint.reader import read_tensors

pytestmark = pytest.mark.reads("resumed_4p", "shared_2p", "resumed_2p")

TOLERANCE = 1e-5


@pytest.mark.parametrize("layout", PIPELINED)
def test_pipeline_trains_every_weight_as_one_process(runs, eager_grads, layout):
    """After one step, every stage's every parameter has the single-process gradient: no stage's weight is left
    untrained (or scaled by the micro-batch count) behind a plausible curve."""
    assert_grads_match(load_grads(runs[layout]), eager_grads(layout), TOLERANCE)


@pytest.mark.parametrize("layout", PIPELINED)
def test_the_logging_rank_reports_the_true_loss_and_norm(runs, layout):
    """Rank 0 logs; it holds the first stage, which never sees the loss: the logged loss and the clipped norm are
    the single-process run's, summed over every stage."""
    ref = {m["step"]: m for m in read_metrics(runs[SHARED_RUNS[layout].reference])}
    for m in read_metrics(runs[layout]):
        assert m["loss"] == pytest.approx(ref[m["step"]]["loss"], abs=TOLERANCE, rel=0)
        assert m["grad_norm"] == pytest.approx(ref[m["step"]]["grad_norm"], rel=TOLERANCE, abs=0)


def test_validation_under_pipeline_gives_the_true_loss(runs):
    # The resumed TP 2 x FSDP 2 run validates on the same batches (2 of them, every 2 steps) at steps 6 and 8.
    pp = {m["step"]: m["val_loss"] for m in read_metrics(runs["pp2_fsdp2"]) if "val_loss" in m}
    ref = {m["step"]: m["val_loss"] for m in read_metrics(runs["tp2_fsdp2_resumed"]) if "val_loss" in m}
    assert sorted(pp) == [2, 4, 6, 8] and sorted(ref) == [6, 8]
    assert [pp[s] for s in ref] == pytest.approx([ref[s] for s in ref], abs=TOLERANCE, rel=0)


def test_pipeline_resumes_bitwise_with_async_saves_keeping_the_latest_2(runs):
    folder = runs["pp2_gpipe_resumed"]  # stopped after step 4
    assert curve(folder) == curve(runs["pp2_gpipe"])
    assert sorted(os.listdir(folder / "checkpoint")) == ["step-6", "step-8"]


def test_pipeline_checkpoint_resumes_on_fsdp_and_back(runs, resharded):
    """PP 2 x FSDP 2's step 4 goes on as FSDP 4 to step 6, and that as PP 2 x FSDP 2 to step 8 (run_table.RESHARD_LEGS):
    the state (model, optimizer moments, data position) and curve of the FSDP 4 run that never changed layout."""
    fsdp, folder = runs["fsdp4"], resharded["pp_to_fsdp4"]
    assert_same_state(ckpt(folder, 6), ckpt(fsdp, 6))
    assert_continues(folder, fsdp, first_step=5)
    assert_same_state(ckpt(folder, 8), ckpt(fsdp, 8))


def test_a_tied_table_resumes_across_layouts_as_one_parameter(runs):
    """Qwen3's tied embeddings, held by both end stages of PP 2 x TP 2, saved at step 2 and resumed on HSDP 2 x CP 2:
    the straight run's steps 3 and 4; and in every checkpoint the table and the output projection are one tensor,
    bitwise (the stages took the same updates), with one set of AdamW moments under the one-process name."""
    straight, resumed = runs["pp2_tp2_qwen3"], runs["pp2_tp2_qwen3_on_hsdp2_cp2"]
    assert_same_curve(resumed, straight, TOLERANCE, steps=range(3, 5))
    for folder in (ckpt(straight, 2), ckpt(straight, 4), ckpt(resumed, 4)):
        t = read_tensors(str(folder))
        assert torch.equal(t["model.tok_embeddings.weight"], t["model.output.weight"]), folder
        assert "optimizer.state.tok_embeddings.weight.exp_avg" in t and not any("state.output" in k for k in t)
