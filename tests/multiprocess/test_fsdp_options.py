"""Every FSDP2 option leaves the loss curve where it was: the same 4-process FSDP run with them on agrees with the
shared run without them to 1e-5 (the gradient reduce's summation order may move the last bits). That each option
reaches fully_shard is checked in tests/test_parallelize.py.

Two runs carry all the options, so the suite pays two launches: each option changes when or where a tensor lives,
not what is computed, so one that broke the numerics would show in its run's curve.
"""

import pytest

from conftest import SHORT
from launch import COMMON, losses, torchrun

TOLERANCE = 1e-5
RUNS = {
    # hpZ over pairs of the 4 shards, two blocks prefetched each way, and 2 micro-batches of 1 per rank reduced once
    # after the last; the output and input casts are fp32 here, so they are only shown to run.
    "hpz_prefetch_deferred_reduce": (
        "--parallelism.fsdp_reshard_after_forward", "2", "--parallelism.fsdp_prefetch", "2",
        "--training.local_batch_size", "1", "--parallelism.fsdp_defer_grad_reduce",
        "--training.mixed_precision_output", "float32", "--no-training.mixed_precision_cast_forward_inputs"),
    # Parameters, gradients and AdamW's state in host memory (here the device is the host too), unpinned.
    "offload_reshard_always": (
        "--parallelism.fsdp_cpu_offload", "--no-parallelism.fsdp_offload_pin_memory",
        "--parallelism.fsdp_reshard_after_forward", "always"),
}


@pytest.mark.parametrize("name", RUNS)
def test_fsdp_option_leaves_the_curve_unchanged(runs, tmp_path, name):
    torchrun(4, tmp_path, *COMMON, *RUNS[name], *SHORT)
    curve, ref = losses(tmp_path), losses(runs["fsdp4"])
    assert sorted(curve) == list(range(1, 7))
    worst = max(abs(curve[s] - ref[s]) for s in curve)
    assert worst <= TOLERANCE, f"max |diff| {worst:.2e}"
