"""A mixture of experts (models/common/moe.py: the tests' model with every block a mixture of 8 experts, top 2, and
Qwen3-MoE's kind, 16 experts, top 4) on every kind of layout (data, context, tensor and pipeline parallel), with
expert parallelism and without, gives its single-process run: first every token's routing decision at step 1, then
the curve within 1e-5, the grad norm within 1e-5 relative, and every parameter's gradient (router, experts) at step 1;
with the routed experts in MXFP8 too (the moe_mxfp8 rows: every scale one process's, quantization/mxfp8_experts.py).

Routing is discontinuous: where a layout's router scores differ from one process's by a rounding, a token whose k-th
and (k+1)-th scores are closer than that goes to another expert, and the numbers after it differ by more than any
tolerance. So the routes are compared first, and a failure says which it saw: a flipped decision (with the token's
margin) or a wrong number. The runs are run_table.py's MOE_RUNS."""

import pytest
import torch

from grad_dump import assert_grads_match, assert_same_bits, load_grads
from launch import COMMON, TINY, assert_same_curve, ckpt, losses, metric
from route_dump import assert_same_routes, load_routes
from run_table import MOE_RUNS

from torchtitan_lite.checkpoint.reader import read_metadata, read_tensors
from torchtitan_lite.config import load_config
from torchtitan_lite.models import registry

# moe_ep2, moe_tp2 and the resumed runs; the 4-process runs are in the job that starts with the session
pytestmark = pytest.mark.reads("shared_2p", "resumed_2p", "resumed_4p")
TOLERANCE = 1e-5
# fp32's: bf16 rounds otherwise than one process's autocast; its layouts are compared with their bf16 twins instead
LAYOUTS = [name for name, run in MOE_RUNS.items() if run.reference is not None and run.record
           and run.config.training.mixed_precision_param == "float32"]
BF16_TOLERANCE = 4e-3  # test_pairs.py's for bf16


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_layout_routes_every_token_as_one_process(runs, layout):
    smallest, moved = assert_same_routes(load_routes(runs[layout]), load_routes(runs[MOE_RUNS[layout].reference]),
                                         layout)
    print(f"{layout}: every token's experts as one process's; smallest top-k margin {smallest:.2e}, margins "
          f"moved by at most {moved:.2e}")
    assert moved < smallest / 10  # far from a flip: the data keeps the decisions stable on every layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_layout_follows_the_single_process_curve(runs, layout):
    assert sorted(losses(runs[layout])) == [1, 2, 3, 4]
    assert_same_curve(runs[layout], runs[MOE_RUNS[layout].reference], TOLERANCE)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_layout_gives_every_gradient_of_one_process(runs, layout):
    assert_grads_match(load_grads(runs[layout]), load_grads(runs[MOE_RUNS[layout].reference]), TOLERANCE)


def test_every_layout_balances_the_experts_by_the_same_bias_bit_for_bit(runs):
    """DeepSeek-V3's bias after 4 updates, from each step's load summed over the ranks that hold different tokens:
    the same bits on one process, FSDP 4, EP 4, EP 2 x CP 2, EP 2 x TP 2 and EP 2 x PP 2 (an update from one rank's
    counts alone, without the other cp or tp rank's part of each sequence, or from counts of a recompute or of a
    pipeline's metadata inference, would differ)."""
    def biases(name: str) -> dict[str, torch.Tensor]:
        return {k: v for k, v in read_tensors(str(ckpt(runs[name], 4))).items() if k.endswith("router.expert_bias")}
    ref = biases("moe_single")
    assert len(ref) == 2 and all(b.abs().sum() > 0 for b in ref.values()), ref
    for name in ("moe_fsdp4", "moe_ep4", "moe_ep2_cp2", "moe_ep2_tp2", "moe_ep2_pp2"):
        got = biases(name)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), (name, got, ref)


@pytest.mark.parametrize("layout", ["moe_single", *LAYOUTS])
def test_every_routed_slot_is_counted_once_on_every_layout(runs, layout):
    """The load logged at each step counts each token's k slots in each MoE layer once: recomputed blocks (full AC on
    HSDP 2 x 2, every other block on EP 2) count nothing twice; a multi-token prediction module's mixture is a layer
    too (DeepSeek-V3's, numbered after the blocks)."""
    cfg = load_config(["--job.config_file", str(TINY), *COMMON, *MOE_RUNS[layout].argv])
    args = registry.get(cfg.model.name).flavors[cfg.model.flavor]
    depth = cfg.model.mtp_depth if cfg.model.mtp_depth is not None else getattr(args, "mtp_depth", 0)
    moe_layers = sum(args.moe.is_moe(i) for i in range(args.n_layers + depth))
    top_k = cfg.moe.top_k or args.moe.top_k  # the config's [moe] over the flavor's
    slots = cfg.training.global_batch_size * cfg.training.seq_len * top_k * moe_layers
    assert metric(runs[layout], "routed_slots") == {step: slots for step in (1, 2, 3, 4)}
    # The load of each layer, named as the model names it whatever wraps its blocks (checkpointing here)
    reference = runs[MOE_RUNS[layout].reference or layout]
    assert metric(runs[layout], "expert_load/layers.0.moe") == metric(reference, "expert_load/layers.0.moe")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_auxiliary_loss_is_the_single_processs_on_every_layout(runs, layout):
    """The Switch/Mixtral loss (tiny_moe's at 0.02, Qwen3-MoE's at 0.001), each sequence's from its own tokens: the
    same mean over the global batch however the ranks and micro-batches cut it (its gradient is among those compared
    above)."""
    got, ref = metric(runs[layout], "aux_loss"), metric(runs[MOE_RUNS[layout].reference], "aux_loss")
    assert got.keys() == ref.keys() == {1, 2, 3, 4}
    worst = max(abs(got[s] - ref[s]) / ref[s] for s in ref)
    print(f"{layout}: auxiliary loss {got[1]:.6f} at step 1, within {worst:.1e} of one process's")
    assert worst <= 1e-6


CAPACITY_LAYOUTS = [name for name in LAYOUTS if MOE_RUNS[name].config.moe.capacity_factor]


@pytest.mark.parametrize("layout", CAPACITY_LAYOUTS)
def test_an_expert_capacity_drops_the_single_processs_slots_on_every_layout(runs, layout):
    """Megatron's capacity at factor 1 (run_table's E6: each expert at most 22 of a 64-token sequence's slots) drops
    slots at every step, and the same fraction on the layout as on one process, exactly: the capacity is each
    sequence's, and a tp rank holding half of a sequence counts the other half's earlier slots (with one rank's own
    counts alone, 0.1016 of the slots dropped at step 1 instead of 0.0718, measured under CP 2). Its routes and
    gradients are among those compared above; under CP and PP it is test_muon.py's resumed leg."""
    assert any(MOE_RUNS[name].dims.tp > 1 and MOE_RUNS[name].dims.ep > 1 for name in CAPACITY_LAYOUTS)
    got, ref = metric(runs[layout], "dropped"), metric(runs[MOE_RUNS[layout].reference], "dropped")
    assert got.keys() == ref.keys() == {1, 2, 3, 4} and all(ref[s] > 0 for s in ref), ref
    print(f"{layout}: {ref[1]:.4f} of the slots dropped at step 1, as on one process at every step")
    assert got == ref
    assert metric(runs["moe_single"], "dropped") == {}  # dropless: not logged


Z_LAYOUTS = [name for name in LAYOUTS if MOE_RUNS[name].config.training.z_loss > 0]


@pytest.mark.parametrize("layout", Z_LAYOUTS)
def test_the_z_losses_are_the_single_processs_on_every_layout(runs, layout):
    """PaLM's z-loss of the output logits (under TP 2 from their vocabulary shards: loss parallel) and ST-MoE's of the
    routers' (each rank's tokens), logged apart from the loss: one process's within 1e-6 at every step. Their
    gradients are among those compared above; their formulas are test_z_loss.py's and test_moe.py's."""
    assert any(MOE_RUNS[name].dims.tp > 1 and not MOE_RUNS[name].config.parallelism.disable_loss_parallel
               for name in Z_LAYOUTS)
    for name in ("z_loss", "router_z_loss"):
        got, ref = metric(runs[layout], name), metric(runs[MOE_RUNS[layout].reference], name)
        assert got.keys() == ref.keys() == {1, 2, 3, 4}, name
        worst = max(abs(got[s] - ref[s]) / ref[s] for s in ref)
        print(f"{layout}: {name} {got[1]:.6f} at step 1, within {worst:.1e} of one process's")
        assert worst <= 1e-6, name


MTP_LAYOUTS = [name for name in LAYOUTS if MOE_RUNS[name].model == "deepseek_v3"]


@pytest.mark.parametrize("layout", MTP_LAYOUTS)
def test_multi_token_prediction_is_the_single_processs_on_every_layout(runs, layout):
    """DeepSeek-V3's debug model trains one MTP module (a mixture block: its routes are among those compared first,
    its gradients among those above, the embedding's and output's with its share), its targets shifted on whole
    windows before context parallelism cuts them, the module on the last pipeline stage with the embedding table
    the first stage shares. Its loss, logged apart, is one process's within 1e-6 at every step; the formula is
    tests/test_mtp.py's."""
    assert {MOE_RUNS[name].dims.cp > 1 for name in MTP_LAYOUTS} == {MOE_RUNS[name].dims.pp > 1
                                                                     for name in MTP_LAYOUTS} == {True, False}
    ref = runs[MOE_RUNS[layout].reference]
    assert "mtp.0.moe" in load_routes(ref) and any(n.startswith("mtp.0.") for n in load_grads(ref))
    got, want = metric(runs[layout], "mtp_loss"), metric(ref, "mtp_loss")
    assert got.keys() == want.keys() == {1, 2, 3, 4}
    worst = max(abs(got[s] - want[s]) / want[s] for s in want)
    print(f"{layout}: mtp_loss {got[1]:.6f} at step 1, within {worst:.1e} of one process's")
    assert worst <= 1e-6


@pytest.mark.parametrize("run", ["moe_mxfp8_single", "moe_mxfp8_hp_single"])
def test_mxfp8_experts_stay_near_fp32_and_are_not_it(runs, run):
    """The routed experts in MXFP8 (emulated) against the fp32 mixture, 4 steps of the same batches ("moe_single"
    accumulates them in 4 micro-batches, which fp32's layouts show changes them by 1e-5 at most): measured, the
    largest relative gap 6.1e-4 for mxfp8 and 6.3e-4 for mxfp8_wgrad_with_hp, step 1 within 2.7e-6. MXFP8's e4m3
    rounds each element by up to 2**-4, but a matmul sums hundreds, and a layer's output was 23.7 dB from fp32
    (tests/test_mxfp8_experts.py). Experts that silently stayed in fp32 would give a gap of 1e-5 at most."""
    got, fp32 = metric(runs[run], "loss"), metric(runs["moe_single"], "loss")
    gaps = {step: abs(loss - fp32[step]) / fp32[step] for step, loss in got.items()}
    print(f"{run}: relative gap to fp32 {max(gaps.values()):.2e} at most, step 1 {gaps[1]:.2e}")
    assert sorted(gaps) == [1, 2, 3, 4] and 5e-5 < max(gaps.values()) <= 5e-3


def test_expert_parallelism_in_bf16_follows_one_process_in_bf16(runs):
    """FSDP2's bf16 parameters and all-to-alls of bf16 slots against one process under autocast, within the bf16
    tolerance of the dense model's pairs (test_pairs.py); no route or gradient compared, bf16's roundings differ."""
    assert sorted(losses(runs["moe_ep2_bf16"])) == [1, 2]  # step 2: the first after an update
    assert_same_curve(runs["moe_ep2_bf16"], runs["moe_single_bf16"], BF16_TOLERANCE)


def test_op_level_checkpointing_under_expert_parallelism_gives_the_run_without_it_bit_for_bit(runs):
    """EP 2 in bf16 keeping each block's matmuls and all-to-alls and recomputing the rest in backward, the experts'
    own FSDP units inside the block (their hooks outside the recompute's count: parallel/selective_ac.py), against
    the same run without checkpointing: routes, gradients, every step's losses and load the same bits. That the
    recompute runs no all-to-all is test_collectives.py's count."""
    assert_same_bits(runs["moe_ep2_bf16_op_sac"], runs["moe_ep2_bf16"])


@pytest.mark.parametrize("saved, resumed", [("moe_fsdp4", "moe_fsdp4_on_ep2"), ("moe_ep2_tp2", "moe_ep2_tp2_on_ep4"),
                                            ("moe_ep4", "moe_ep4_on_fsdp2")])
def test_a_moe_checkpoint_resumes_across_expert_parallel_degrees_on_the_same_curve(runs, saved, resumed):
    """Step 2 saved without EP goes on with EP 2, saved on EP 2 (over TP 2 x FSDP 2) goes on with EP 4, and saved on
    EP 4 (2 experts a rank) goes on without EP, to step 4: the experts' weights and their AdamW moments are in the
    checkpoint whole, and the curve is the saving run's."""
    metadata = read_metadata(str(ckpt(runs[saved], 2))).state_dict_metadata
    for layer in ("0", "1"):
        for name in ("moe.router.gate.weight", "moe.experts.w1", "moe.experts.w2", "moe.experts.w3"):
            assert f"model.layers.{layer}.{name}" in metadata
            assert any(k.startswith("optimizer.") and k.endswith(f"layers.{layer}.{name}.exp_avg")
                       for k in metadata), name
    assert tuple(metadata["model.layers.0.moe.experts.w1"].size)[0] == 8  # every expert, whatever the EP degree
    assert sorted(losses(runs[resumed])) == [1, 2, 3, 4]  # steps 1-2 the saving run's own records
    assert_same_curve(runs[resumed], runs[saved], TOLERANCE, steps=[3, 4])
