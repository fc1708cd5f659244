"""Half precision end to end on the CPU, kept tiny: most CPUs run half-precision matmuls many times slower.

fp16 runs on FSDP 2 with its loss scale starting at 2**24, high enough that some steps overflow: those steps are
skipped and counted, each skip halves the scale, the logged norm is the true gradient's (unscaled before clipping),
and a resume restores the scale, so the curve continues exactly. bf16 trains on one process (autocast) and says once
that half precision is slow on a CPU.
"""

import math
from pathlib import Path

import pytest

from launch import CHECKPOINTED, COMMON, losses, read_metrics, stopped_after, torchrun, train_in_process

SHIM = Path(__file__).parent / "fp16_overflow.py"
# 4 sequences of 16 tokens a step: overflow and the scale's bookkeeping show at any size; fp16 matmuls are slow here.
FP16 = (*COMMON, "--training.global_batch_size", "4", "--training.seq_len", "16",
        "--training.mixed_precision_param", "float16", "--training.steps", "6", *CHECKPOINTED)
INIT_SCALE_EXP = 24  # steps 1-3 overflow, 4-6 train: a resume after step 2 that reset the scale would differ
KEYS = ("step", "loss", "grad_norm", "loss_scale", "skipped_steps")


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fp16")
    torchrun(2, folder, *FP16, script=SHIM, script_args=(str(INIT_SCALE_EXP),))
    return folder


def test_fp16_skips_overflowed_steps_and_counts_them(fp16_run):
    m = read_metrics(fp16_run)
    skipped = [r["step"] for r in m if not math.isfinite(r["grad_norm"])]
    assert skipped and len(skipped) < len(m), skipped  # some overflowed, and training went on
    assert [r["skipped_steps"] for r in m] == [sum(s <= r["step"] for s in skipped) for r in m]
    assert [r["loss_scale"] for r in m] == [2.0**INIT_SCALE_EXP / 2 ** r["skipped_steps"] for r in m]
    # A norm taken before unscaling would be the loss scale (here 2**21) times the true one (~1).
    assert all(r["grad_norm"] < 10 for r in m if r["step"] not in skipped)
    assert all(math.isfinite(r["loss"]) for r in m) and m[-1]["loss"] < m[0]["loss"]


def test_fp16_resume_restores_the_loss_scale(fp16_run, tmp_path):
    folder = stopped_after(fp16_run, 2, tmp_path)
    torchrun(2, folder, *FP16, script=SHIM, script_args=(str(INIT_SCALE_EXP),))
    subset = lambda run: [{k: r[k] for k in KEYS} for r in read_metrics(run)]  # noqa: E731
    assert subset(folder) == subset(fp16_run)  # bitwise, skipped steps and scale included


def test_bf16_trains_on_one_process_and_warns_once(tmp_path):
    train_in_process(tmp_path / "fp32", "--training.steps", "3")
    fp32 = losses(tmp_path / "fp32")
    proc = train_in_process(tmp_path / "bf16", "--training.steps", "3", "--training.mixed_precision_param",
                            "bfloat16")
    assert (proc.stdout + proc.stderr).count("half-precision matmuls") == 1
    bf16 = losses(tmp_path / "bf16")
    assert bf16.keys() == fp32.keys() and bf16 != fp32  # computed in bf16, not silently in fp32
    assert all(abs(bf16[s] - fp32[s]) < 0.05 for s in fp32)
