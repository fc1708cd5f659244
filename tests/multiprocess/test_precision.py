"""Half precision end to end on the CPU, kept tiny: most CPUs run half-precision matmuls many times slower.

fp16 runs with its loss scale starting at 2**20, high enough that the first steps overflow, and with rank 1's
gradients made inf at step 5 (fp16_overflow.py), on FSDP 2 and on a 2-stage pipeline (where step 5 overflows in the
last stage alone), in one job. Every rank skips the same steps, counted (the all-reduced gradient norm decides), each
skip halves the scale, which stays the same on every rank, the logged norm is the true gradient's (unscaled before
clipping), and a resume restores the scale, so the curve continues exactly. bf16 trains on one process (autocast) and
says once that half precision is slow on a CPU.
"""

import json
import math
from pathlib import Path

import pytest

from launch import (CHECKPOINTED, COMMON, PP2, ckpt, losses, read_metrics, stopped_after, torchrun_several,
                    train_in_process)
from torchtitan_lite.checkpoint.reader import read_tensors

SHIM = Path(__file__).parent / "fp16_overflow.py"
# 4 sequences of 16 tokens a step: overflow and the scale's bookkeeping show at any size; fp16 matmuls are slow here.
FP16 = (*COMMON, "--training.global_batch_size", "4", "--training.seq_len", "16",
        "--training.mixed_precision_param", "float16", "--training.steps", "6", *CHECKPOINTED)
# Steps 1-2 overflow everywhere, 3, 4 and 6 train, 5 overflows on rank 1 alone: a resume after step 2 that reset the
# scale would differ, and a stage deciding alone would step at 5.
SHIM_ARGS = ("20", "1:5")
LEGS = {"fsdp2": (), "pp2": (*PP2, "--training.local_batch_size", "4")}
KEYS = ("step", "loss", "grad_norm", "loss_scale", "skipped_steps")


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp16")
    torchrun_several(2, [(root / name, False, (*FP16, *legs)) for name, legs in LEGS.items()], script=SHIM,
                     script_args=SHIM_ARGS)
    return {name: root / name for name in LEGS}


def skipped(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run) if not math.isfinite(r["grad_norm"])]


@pytest.mark.parametrize("leg", LEGS)
def test_fp16_skips_overflowed_steps_on_every_rank_with_one_loss_scale(fp16_runs, leg):
    m, bad = read_metrics(fp16_runs[leg]), skipped(fp16_runs[leg])
    assert 5 in bad and len(bad) < len(m), bad  # rank 1's overflow skipped; training went on
    assert [r["skipped_steps"] for r in m] == [sum(s <= r["step"] for s in bad) for r in m]
    scales = [2.0**20 / 2 ** r["skipped_steps"] for r in m]
    assert [r["loss_scale"] for r in m] == scales
    for rank in (0, 1):  # each rank's own scale after each step, not rank 0's logged one
        assert list(json.loads((fp16_runs[leg] / f"loss_scale-{rank}.json").read_text()).values()) == scales
    # A norm taken before unscaling would be the loss scale (here 2**18) times the true one (~1).
    assert all(r["grad_norm"] < 10 for r in m if r["step"] not in bad)
    assert all(math.isfinite(r["loss"]) for r in m) and m[-1]["loss"] < m[0]["loss"]


def test_an_overflow_in_one_pipeline_stage_skips_the_step_in_every_stage(fp16_runs):
    """Every parameter of both stages was updated at the same steps: AdamW's step counts all equal the trained
    steps, in the checkpoint of the last step."""
    saved = read_tensors(str(ckpt(fp16_runs["pp2"], 6)))
    counts = {k: v.item() for k, v in saved.items() if k.startswith("optimizer.state.") and k.endswith(".step")}
    assert any(".layers.0." in k for k in counts) and any(".output." in k for k in counts)  # both stages
    assert set(counts.values()) == {6 - len(skipped(fp16_runs["pp2"]))}, counts


def test_fp16_resume_restores_the_loss_scale(fp16_runs, tmp_path):
    folder = stopped_after(fp16_runs["fsdp2"], 2, tmp_path / "fsdp2")
    torchrun_several(2, [(folder, False, FP16)], script=SHIM, script_args=SHIM_ARGS)
    subset = lambda run: [{k: r[k] for k in KEYS} for r in read_metrics(run)]  # noqa: E731
    assert subset(folder) == subset(fp16_runs["fsdp2"])  # bitwise, skipped steps and scale included


def test_bf16_trains_on_one_process_and_warns_once(tmp_path):
    train_in_process(tmp_path / "fp32", "--training.steps", "3")
    fp32 = losses(tmp_path / "fp32")
    proc = train_in_process(tmp_path / "bf16", "--training.steps", "3", "--training.mixed_precision_param",
                            "bfloat16")
    assert (proc.stdout + proc.stderr).count("half-precision matmuls") == 1
    bf16 = losses(tmp_path / "bf16")
    assert bf16.keys() == fp32.keys() and bf16 != fp32  # computed in bf16, not silently in fp32
    assert all(abs(bf16[s] - fp32[s]) < 0.05 for s in fp32)
