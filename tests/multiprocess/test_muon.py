"""Muon (training/muon.py) is exact when sharded: on TP 2 x FSDP 2 x EP 2, where TP splits attention's matrices on
either dim, FSDP the rest and the routed experts on dim 1, and EP the experts, every matrix is orthogonalized whole,
so the curve and grad norm are one process's within 1e-5, and every matrix and its momentum buffer after steps 1, 2
and 4 within 1e-6 of its largest value (run_table.py's moe_e6_muon runs; their routes, gradients at step 1, auxiliary
losses and z-losses are test_moe_layouts.py's). Its state saved there resumes on PP 2 x CP 2 x EP 2, offloaded to the
host, to the same curve, weights and slots dropped over the experts' capacity; HSDP's replicas train by Muon in the
DeepSeek-V3 rows (test_moe_layouts.py). A Newton-Schulz step on a shard is another update: the check fails by 1e-1
then (9.7e-2 at step 2, measured by hand; a transposed result all-reduced as it lay in memory, found this way, by
1e-2)."""

import pytest
import torch

from launch import assert_same_curve, ckpt, metric
from run_table import MOE_RUNS, RESUMED_RUNS

from torchtitan_lite.checkpoint.reader import read_tensors

# The 4-process runs are in the job that starts with the session; the resumed ones in the job of their size.
pytestmark = pytest.mark.reads("shared_2p", "resumed_4p")
LAYOUT, SINGLE = "moe_e6_muon_ep2_tp2", "moe_e6_muon_single"
LEGS = ["moe_e6_muon_on_pp2_cp2"]


def test_muons_curve_and_grad_norm_are_one_processs(runs):
    assert MOE_RUNS[LAYOUT].reference == SINGLE
    assert_same_curve(runs[LAYOUT], runs[SINGLE], 1e-5)


@pytest.mark.parametrize("step", [1, 2, 4])
def test_every_weight_and_momentum_is_one_processs(runs, step):
    """Muon's matrices and their momentum within 1e-6 of their largest value; AdamW's parameters (norms, routers,
    embeddings) within 1e-5: AdamW divides a gradient by its own running magnitude, so where a router's gradients are
    tiny, their last bits (the reduction order) move its update by more (3e-6 seen here, as with AdamW alone)."""
    worst = worst_differences(runs[LAYOUT], runs[SINGLE], step)
    print(f"step {step}: Muon's weights and momentum within {worst['muon']:.1e} of one process's, AdamW's within "
          f"{worst['adamw']:.1e}, relative")
    assert worst["muon"] <= 1e-6 and worst["adamw"] <= 1e-5


@pytest.mark.parametrize("leg", LEGS)
def test_muons_state_resumes_on_pp_and_cp_on_one_processs_curve_and_weights(runs, leg):
    """Step 2 saved on TP 2 x FSDP 2 x EP 2 goes on to step 4 on PP 2 x CP 2 x EP 2, offloaded: the single process's
    curve, grad norm and z-losses (the pipeline's last stage computes the output's), and its weights and momentum at
    step 4 within test_every_weight_and_momentum_is_one_processs's bounds."""
    assert RESUMED_RUNS[leg].run == LAYOUT and RESUMED_RUNS[leg].after_step == 2
    assert_same_curve(runs[leg], runs[SINGLE], 1e-5, steps=[3, 4])
    for name in ("z_loss", "router_z_loss"):
        got, ref = metric(runs[leg], name), metric(runs[SINGLE], name)
        assert all(abs(got[s] - ref[s]) <= 1e-6 * ref[s] for s in (3, 4)), (name, got, ref)
    # The expert capacity (run_table's E6) drops one process's slots from head-tail chunks of each sequence
    got, ref = metric(runs[leg], "dropped"), metric(runs[SINGLE], "dropped")
    assert ref[3] > 0 and ref[4] > 0 and got[3] == ref[3] and got[4] == ref[4], (got, ref)
    worst = worst_differences(runs[leg], runs[SINGLE], 4)
    print(f"{leg}: Muon's weights and momentum at step 4 within {worst['muon']:.1e} of one process's, AdamW's "
          f"within {worst['adamw']:.1e}, relative")
    assert worst["muon"] <= 1e-6 and worst["adamw"] <= 1e-5


def worst_differences(run, single, step: int) -> dict[str, float]:
    """The largest difference of a Muon matrix or momentum buffer, and of an AdamW parameter, at `step` from the
    single process's, relative to its largest value."""
    got, ref = read_tensors(str(ckpt(run, step))), read_tensors(str(ckpt(single, step)))
    assert got.keys() == ref.keys()
    buffers = [k for k in ref if k.endswith(".momentum_buffer")]
    assert any(".experts.w1." in k for k in buffers) and any("attention.wo" in k for k in buffers)
    assert not any("router" in k or "norm" in k or "tok_embeddings" in k for k in buffers)  # AdamW's
    muon = {f"model.{k.removeprefix('optimizer.state.').removesuffix('.momentum_buffer')}" for k in buffers}
    assert muon <= ref.keys()
    worst = {"muon": 0.0, "adamw": 0.0}
    for key, value in ref.items():
        if value.is_floating_point() and (key.startswith("model.") or key in buffers):
            kind = "muon" if key in muon or key in buffers else "adamw"
            worst[kind] = max(worst[kind], (got[key] - value).abs().max().item() / value.abs().max().item())
    return worst
