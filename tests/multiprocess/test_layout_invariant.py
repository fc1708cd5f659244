"""training.layout_invariant: every layout it covers gives the single process's bits, not a curve within 1e-5. The
loss and grad norm of every step are equal as floats, and every tensor of every checkpoint (weights and AdamW's
moments) has the same bytes. A checkpoint of one layout resumes on another bitwise. And the bitwise check
catches what the tolerance hides: a gradient off by one part in 2**20, a reduction missed on one rank, a flipped route.

The runs are the shared runs of INVARIANT_RUNS (run_table.py); the errors are made on purpose by mutants.py, on one
process in this one, and the missed reduction on 2 in a job of its own."""

import contextlib
from pathlib import Path

import pytest
import torch

import made_later
from grad_dump import assert_grads_match, load_grads, recording
from launch import COMMON, ROOT, STEPS, assert_same_curve, curve, torchrun_several, train_in_process
from mutants import made_wrong
from route_dump import assert_same_routes, load_routes
from invariant_runs import INVARIANT, INVARIANT_RUNS, MOE_INVARIANT, TWO_STEPS
from run_table import RESUMED_RUNS
from torchtitan_lite.checkpoint.reader import read_tensors

MUTANTS = ROOT / "tests" / "multiprocess" / "mutants.py"
WRONG = ("--model.name", "llama3", *INVARIANT, *TWO_STEPS)


def make_unreduced(folder: Path) -> Path:
    """FSDP 2 with a reduction missed on rank 1 (mutants.py: the folder's name says which error)."""
    torchrun_several(2, [(folder / "fsdp2_unreduced", False, (*COMMON, *WRONG))], script=MUTANTS)
    return folder / "fsdp2_unreduced"


def made_wrong_here(folder: Path, kind: str, argv: tuple[str, ...], record: bool = False) -> Path:
    """One process in this one, trained with the error `kind` (mutants.py)."""
    with made_wrong(kind), recording(folder) if record else contextlib.nullcontext():
        train_in_process(folder, *COMMON, "--training.steps", str(STEPS), *argv)
    return folder


made_later.register("layout_invariant_unreduced", make_unreduced)
pytestmark = pytest.mark.reads("shared_2p", "resumed_2p", "layout_invariant_unreduced")
LAYOUTS = [name for name, run in INVARIANT_RUNS.items() if run.reference is not None]


def saved(folder: Path, step: int) -> dict[str, torch.Tensor]:
    return read_tensors(str(folder / "checkpoint" / f"step-{step}"))


def differing(got: Path, ref: Path, step: int) -> list[str]:
    """The saved tensors of `got` at `step` whose bytes are not `ref`'s (NaN payloads and -0.0 included)."""
    a, b = saved(got, step), saved(ref, step)
    assert a.keys() == b.keys() and len(b) > 20, f"{sorted(a.keys() ^ b.keys())}"
    return [k for k in b if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or
            not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]


def assert_bitwise(got: Path, ref: Path) -> None:
    """Every step's loss and grad norm, and every tensor of every checkpoint `got` saved, `ref`'s bits."""
    a, b = curve(got), curve(ref)
    assert a and set(a) <= set(b), f"steps {sorted(a)} vs {sorted(b)}"
    unequal = {s: (a[s], b[s]) for s in a if a[s] != b[s]}
    assert not unequal, f"(loss, grad norm) differ at {unequal}"
    steps = sorted(int(p.name.split("-")[1]) for p in (got / "checkpoint").glob("step-*"))
    assert steps, f"{got} saved no checkpoint"
    for step in steps:
        assert not (bad := differing(got, ref, step)), f"step {step}: {len(bad)} saved tensors differ, {bad[:3]}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_gives_the_single_process_bits(runs, layout):
    ref = runs[INVARIANT_RUNS[layout].reference]
    if INVARIANT_RUNS[layout].record:  # a mixture: every token went to the same experts first, then every number
        assert_same_routes(load_routes(runs[layout]), load_routes(ref), layout)
        print(f"{layout}: every token's experts as one process's")
    assert_bitwise(runs[layout], ref)
    print(f"{layout}: loss and grad norm of steps {sorted(curve(runs[layout]))} and every tensor it saved bitwise one "
          "process's")


def test_a_checkpoint_of_one_layout_resumes_on_another_bitwise(runs):
    resumed = runs["inv_fsdp4_on_ddp2"]
    assert RESUMED_RUNS["inv_fsdp4_on_ddp2"].run == "inv_fsdp4"
    assert sorted(curve(resumed)) == [1, 2, 3, 4]  # 1 and 2 FSDP 4's (its history, resumed), 3 and 4 DDP 2's
    assert_bitwise(resumed, runs["inv_single"])


def test_the_default_mode_differs_where_the_invariant_one_does_not(runs):
    """The same layouts without the mode (test_layouts.py's shared runs) differ from one process in the last bits:
    what the mode removes is there to remove."""
    a, b = curve(runs["fsdp4"]), curve(runs["single"])
    assert any(a[s] != b[s] for s in a)


def test_a_gradient_off_by_one_part_in_2_to_the_20_passes_the_tolerance_not_the_bits(runs, tmp_path):
    folder, ref = made_wrong_here(tmp_path, "factor", WRONG), runs["inv_single"]
    assert_same_curve(folder, ref, 1e-5)  # what the 1e-5 parity tests would say: the same curve
    with pytest.raises(AssertionError, match="differ"):
        assert_bitwise(folder, ref)


def test_a_reduction_missed_on_one_rank_breaks_the_bits(runs, made):
    with pytest.raises(AssertionError, match="differ"):
        assert_bitwise(made("layout_invariant_unreduced"), runs["inv_single"])


def test_a_flipped_route_is_named_as_one_before_any_number(runs, tmp_path):
    ref = runs["inv_moe_single"]
    folder = made_wrong_here(tmp_path, "flipped", ("--model.name", "llama3", *MOE_INVARIANT), record=True)
    with pytest.raises(AssertionError, match="a flipped routing decision"):
        assert_same_routes(load_routes(folder), load_routes(ref), "one process, a route flipped")
    with pytest.raises(AssertionError, match="differ"):
        assert_bitwise(folder, ref)


def test_every_gradient_at_step_1_is_the_single_process_bits(runs):
    """The mixture's gradients before clipping, recorded at step 1 (grad_dump.py): tolerance 0."""
    assert_grads_match(load_grads(runs["inv_moe_fsdp4_ep2"]), load_grads(runs["inv_moe_single"]), 0.0)
