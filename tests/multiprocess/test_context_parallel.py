"""Context parallelism trains the single-process model exactly: the same curve, the same gradient for every
parameter, the true validation loss, and checkpoints that know no layout.

The runs are the suite's shared CP runs (run_table.py): CP 2 accumulating, CP 2 x FSDP 2 with contiguous chunks, CP 4
recomputing every block, CP 2 x TP 2 compiled, HSDP over cp, CP inside pipeline stages. Their loss curves are in the
layout matrix of test_layouts.py; here, what a curve could hide. Tolerance 1e-5 as there: attention over a chunk
and its prefix of keys rounds in another order than over the whole sequence, nothing more.
"""

import pytest

from run_table import CONTEXT_PARALLEL, SHARED_RUNS
from grad_dump import assert_grads_match, load_grads
from launch import ckpt, read_metrics
from test_checkpoint import assert_continues, assert_same_state

pytestmark = pytest.mark.reads("resumed_4p", "shared_2p", "resumed_2p")

TOLERANCE = 1e-5


@pytest.mark.parametrize("layout", CONTEXT_PARALLEL)
def test_context_parallel_trains_every_weight_as_one_process(runs, eager_grads, layout):
    """After one step every parameter has the single-process gradient: the keys' and values' gradients come back
    from every rank's queries (the gather's reduce-scatter), and FSDP sums the cp ranks' shares of the tokens."""
    assert_grads_match(load_grads(runs[layout]), eager_grads(layout), TOLERANCE)


@pytest.mark.parametrize("layout", CONTEXT_PARALLEL)
def test_the_logged_norm_is_the_single_process_one(runs, layout):
    ref = {m["step"]: m["grad_norm"] for m in read_metrics(runs[SHARED_RUNS[layout].reference])}
    for m in read_metrics(runs[layout]):
        assert m["grad_norm"] == pytest.approx(ref[m["step"]], rel=TOLERANCE, abs=0)


def test_validation_under_context_parallel_gives_the_true_loss(runs):
    # PP 2 x FSDP 2 validates on the same batches (2 of them, every 2 steps).
    cp = {m["step"]: m["val_loss"] for m in read_metrics(runs["cp2"]) if "val_loss" in m}
    ref = {m["step"]: m["val_loss"] for m in read_metrics(runs["pp2_fsdp2"]) if "val_loss" in m}
    assert sorted(cp) == sorted(ref) == [2, 4, 6, 8]
    assert [cp[s] for s in ref] == pytest.approx([ref[s] for s in ref], abs=TOLERANCE, rel=0)


def test_context_parallel_resumes_bitwise(runs):
    """CP 2 stopped after step 6 and resumed: steps 7-8 and their validation losses equal the straight run's bitwise."""
    def by_step(run):
        return {m["step"]: (m["loss"], m["grad_norm"], m.get("val_loss")) for m in read_metrics(runs[run])}

    got, ref = by_step("cp2_resumed"), by_step("cp2")
    assert [got[s] for s in range(7, 9)] == [ref[s] for s in range(7, 9)]


def test_context_parallel_checkpoint_resumes_on_fsdp_and_back(runs, resharded):
    """CP 2 x FSDP 2's step 4 goes on as FSDP 4 to step 6, and that back on CP 2 x FSDP 2 to step 8 (conftest's
    resharded legs): the state (model, optimizer moments, data position) and curve of the CP 2 x FSDP 2 run that
    never changed layout. (Not FSDP 4's: AdamW's first steps divide each gradient by its own size, so on the few
    weights whose gradient is near eps the 1e-7 differences of chunked attention become 1e-4 of the weight.)"""
    cp, folder = runs["cp2_fsdp2"], resharded["cp_to_fsdp4"]
    assert_same_state(ckpt(folder, 6), ckpt(cp, 6))
    assert_continues(folder, cp, first_step=5)
    assert_same_state(ckpt(folder, 8), ckpt(cp, 8))
