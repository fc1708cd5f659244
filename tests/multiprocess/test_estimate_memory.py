"""The estimate's state bytes equal what the real trainer holds, byte for byte, on the shared 4-process runs (under
PP, rank 0's: the first stage, or stages 0 and 2 of LoopedBFS's 4; under CP, FSDP's shards over dp_shard x cp)."""

import pytest
from run_table import SHARED_RUNS
from launch import COMMON, STEPS, TINY, read_metrics

from torchtitan_lite.config import load_config
from torchtitan_lite.tools.memory import estimate_memory


@pytest.mark.parametrize("name", ["fsdp4", "tp2_fsdp2", "pp2_fsdp2", "pp2_tp2_looped_bfs", "cp2_fsdp2"])
def test_estimate_equals_the_trainers_held_bytes(runs, name):
    nproc, overrides = SHARED_RUNS[name]
    first = read_metrics(runs[name])[0]
    assert first["step"] == 1
    cfg = load_config(["--job.config_file", str(TINY), *COMMON, "--training.steps", str(STEPS), *overrides])
    estimate = estimate_memory(cfg, nproc)
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert key in first, f"the trainer's step-1 record has no {key}: is metrics.held_bytes wired into train.py?"
        assert first[key] == getattr(estimate, key), key
