"""Document masking (model.attn_mask_type block_causal) on every kind of layout gives its single-process run: the
curve within 1e-5, the grad norm within 1e-5 relative, and every parameter's gradient at step 1.

The runs are run_table.py's MASKED_RUNS, on short documents (tests/assets/documents.jsonl): TP 2 x FSDP 2 compiled
(aot_eager), PP 2 x CP 2 (the documents reach the second stage; CP's head-tail chunks attend under the mask). What masking computes is proven in one process (tests/test_documents.py); here, that every layout carries it.
"""

import pytest

from run_table import MASKED_RUNS
from grad_dump import assert_grads_match, load_grads
from launch import assert_same_curve, losses

TOLERANCE = 1e-5
LAYOUTS = [name for name, run in MASKED_RUNS.items() if run.reference is not None]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_layout_follows_the_masked_single_process_run(runs, layout):
    assert sorted(losses(runs[layout])) == [1, 2, 3, 4]
    assert_same_curve(runs[layout], runs[MASKED_RUNS[layout].reference], TOLERANCE)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_layout_gives_every_gradient_of_one_process(runs, layout):
    assert_grads_match(load_grads(runs[layout]), load_grads(runs[MASKED_RUNS[layout].reference]), TOLERANCE)
