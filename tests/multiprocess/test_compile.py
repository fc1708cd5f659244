"""Compiled blocks train every weight, on every layout, and give eager's numbers.

A loss curve can hide a frozen weight (torch 2.13 once left TP's embedding without a gradient under compile, the curve
off by only 5e-3 after 8 steps: parallelize.EmbeddingParallel), so each compiled layout's gradients after one step are
compared parameter by parameter with the single-process eager run's. The layouts, each compiled per block:
- TP 2, inductor (C++ kernels), full activation checkpointing, 4 steps validating every 2: its curve against the
  single-process eager run's, and graphs that stop growing;
- TP 2 alone, validating and saving every 2 steps, and resumed bitwise from its step 2 by a new job; FSDP 4 with
  every other block recomputed; HSDP 2 x 2 with selective op AC and FSDP's bf16 mixed precision: traced by
  aot_eager, which runs AOTAutograd (where both TP bugs lived) without generating code;
- a mixture of experts on EP 2 in bf16 with selective op AC, compiled in pieces around the dispatch
  (parallel/compile.py) by aot_eager, whose graphs run eager's ops: against the same layout eager without AC, bit for
  bit (routes first), and compiling nothing after step 1 while every dispatch brings other slot counts.
"""

import json

import pytest

from grad_dump import assert_grads_match, assert_same_bits, load_grads
from launch import STEPS, assert_same_curve, curve, losses

pytestmark = pytest.mark.reads("shared_2p", "resumed_2p")  # tp2_compiled, its resumed run, the inductor run

# fp32: a compiled gradient differs from eager's by the order of its reductions (inductor fuses the norms, TP and
# FSDP sum partial results in another order), measured at <= 2e-6 of the parameter's largest gradient; 1e-5 leaves
# margin and still fails a gradient that is missing, zero, or off by a fraction of a percent.
GRAD_TOLERANCE = 1e-5
# bf16 compute (HSDP leg): each matmul rounds to 8 bits of mantissa, ~4e-3 relative, grown through the blocks.
BF16_GRAD_TOLERANCE = 3e-2
# The inductor curve against eager's, over its 4 steps; measured 5e-7 over 8 on TP 2 x FSDP 2 (the reduction order).
CURVE_TOLERANCE = 1e-5

INDUCTOR_STEPS = 4  # run_table.COMPILED_RUNS
# name -> gradient tolerance: run_table.COMPILED_RUNS' aot_eager runs, made in the job of the shared 4-process runs
LAYOUTS = {"fsdp4_ac_every_2_compiled": GRAD_TOLERANCE, "hsdp_op_sac_bf16_compiled": BF16_GRAD_TOLERANCE}


@pytest.fixture(scope="module")
def inductor_run(runs):
    """TP 2 compiled by inductor, every block recomputed, validating every 2 steps."""
    return runs["tp2_inductor"]


@pytest.fixture(scope="module")
def aot_tp2_run(runs):
    return runs["tp2_compiled"]


def test_inductor_tp2_trains_every_weight_as_eager(inductor_run, eager_grads):
    assert_grads_match(load_grads(inductor_run), eager_grads("tp2_inductor"), GRAD_TOLERANCE)


def test_inductor_tp2_follows_the_eager_curve(inductor_run, runs):
    assert sorted(losses(inductor_run)) == list(range(1, INDUCTOR_STEPS + 1))
    assert sorted(losses(runs["single"])) == list(range(1, STEPS + 1))
    assert_same_curve(inductor_run, runs["single"], CURVE_TOLERANCE)  # on the steps both have


def test_nothing_recompiles_after_the_first_step_and_validation(inductor_run):
    """Step 1 builds the training graph, the first validation (step 2, no autograd) the inference graph; steps,
    validations and checkpoint saves after that build nothing."""
    graphs = json.loads((inductor_run / "graphs.json").read_text())
    assert len(graphs) == INDUCTOR_STEPS and graphs[0] >= 1
    assert graphs[1] == graphs[0]  # step 2's training, before its validation
    assert graphs[2] > graphs[1]  # the inference graph of step 2's validation
    assert graphs[2:] == [graphs[2]] * (INDUCTOR_STEPS - 2)


def test_aot_tp2_trains_every_weight_as_eager(aot_tp2_run, eager_grads):
    assert_grads_match(load_grads(aot_tp2_run), eager_grads("tp2_compiled"), GRAD_TOLERANCE)


def test_compiled_run_resumes_on_its_exact_curve(aot_tp2_run, runs):
    """Stopped after step 2 and resumed by a new run (run_table.RESUMED_RUNS): steps 3-6 bitwise, and the new run
    compiles the same graphs once (its first validation, at step 4, adds the inference graph) and never again."""
    folder = runs["tp2_compiled_resumed"]
    straight, resumed = curve(aot_tp2_run), curve(folder)
    assert sorted(straight) == list(range(1, 7))
    assert [resumed[s] for s in range(3, 7)] == [straight[s] for s in range(3, 7)]
    first = json.loads((aot_tp2_run / "graphs.json").read_text())
    assert first == [first[0]] * 2 + [first[2]] * 4 and first[2] > first[0]  # as the inductor run's, above
    assert json.loads((folder / "graphs.json").read_text()) == [first[0]] * 2 + [first[2]] * 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_layout_trains_every_weight_as_eager(layout, eager_grads, runs):
    assert_grads_match(load_grads(runs[layout]), eager_grads(layout), LAYOUTS[layout])


def test_compiled_expert_parallelism_gives_eager_expert_parallelisms_bits(runs):
    """EP 2's dispatch (the split sizes read on the host, the all-to-alls) and the router, the sort and the losses
    around it eager, the rest compiled: every route, gradient, loss, router loss and load the eager run's."""
    assert_same_bits(runs["moe_ep2_bf16_compiled"], runs["moe_ep2_bf16"])


def test_compiled_expert_parallelism_compiles_nothing_after_step_1_though_the_split_sizes_change(runs):
    """Step 1 builds 3 graphs, each shared by the 2 blocks: the norms, attention, and the experts' grouped GEMM with
    its slots' count dynamic (op-level AC's recompute reruns them, building nothing). The experts' graph takes a rank
    other slot counts at every layer and micro-batch (grad_dump's record of each dispatch, recomputes too), step 2
    counts step 1 never saw, and step 2 compiles nothing: no graph for a count."""
    folder = runs["moe_ep2_bf16_compiled"]
    assert json.loads((folder / "graphs.json").read_text()) == [3, 3]
    for rank in sorted(folder.glob("arrivals.*.json")):
        arrivals = json.loads(rank.read_text())
        print(f"{rank.name}: slots arrived by step {arrivals}")
        assert sorted(arrivals) == ["1", "2"] and set(arrivals["2"]) - set(arrivals["1"]), arrivals
        assert len(set(arrivals["1"])) == 4  # 2 layers x 2 micro-batches, each recomputed once
