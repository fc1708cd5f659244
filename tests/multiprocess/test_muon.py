"""Muon (training/muon.py) is exact when sharded: on TP 2 x FSDP 2 x EP 2, where TP splits attention's matrices on
either dim, FSDP the rest and the routed experts on dim 1, and EP the experts, every matrix is orthogonalized whole,
so the curve and grad norm are one process's within 1e-5, and every matrix and its momentum buffer after steps 2 and
4 within 1e-6 of its largest value (run_table.py's moe_e6_muon runs; their routes, gradients at step 1 and auxiliary
loss are test_moe_layouts.py's). A Newton-Schulz step on a shard is another update: the check fails by ~1e-2 then
(a transposed result all-reduced as it lay in memory, found this way, was off by as much)."""

import pytest
import torch

from launch import assert_same_curve, ckpt
from run_table import MOE_RUNS

from torchtitan_lite.checkpoint.reader import read_tensors

pytestmark = pytest.mark.reads("shared_2p")  # the 4-process runs are in the job that starts with the session
LAYOUT, SINGLE = "moe_e6_muon_ep2_tp2", "moe_e6_muon_single"


def test_muons_curve_and_grad_norm_are_one_processs(runs):
    assert MOE_RUNS[LAYOUT].reference == SINGLE
    assert_same_curve(runs[LAYOUT], runs[SINGLE], 1e-5)


@pytest.mark.parametrize("step", [2, 4])
def test_every_weight_and_momentum_is_one_processs(runs, step):
    """Muon's matrices and their momentum within 1e-6 of their largest value; AdamW's parameters (norms, routers,
    embeddings) within 1e-5: AdamW divides a gradient by its own running magnitude, so where a router's gradients are
    tiny, their last bits (the reduction order) move its update by more (3e-6 seen here, as with AdamW alone)."""
    got, ref = read_tensors(str(ckpt(runs[LAYOUT], step))), read_tensors(str(ckpt(runs[SINGLE], step)))
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
    print(f"step {step}: Muon's weights and momentum within {worst['muon']:.1e} of one process's, AdamW's within "
          f"{worst['adamw']:.1e}, relative")
    assert worst["muon"] <= 1e-6 and worst["adamw"] <= 1e-5
