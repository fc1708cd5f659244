"""The estimate's state bytes equal what the real trainer holds, byte for byte, on the shared 4-process runs (under
PP, rank 0's: the first stage, or stages 0 and 2 of LoopedBFS's 4; under CP, FSDP's shards over dp_shard x cp; of a
mixture of experts, its experts split over EP 4, and over EP 2 borrowed from TP 2 x FSDP 2 with a rank's 3 experts
sharded on their dim 1 over FSDP 2); and the estimate says what it is doing as it goes."""

import importlib.util
import logging
import re
from pathlib import Path

import pytest
from run_table import ALL_RUNS
from launch import COMMON, STEPS, TINY, read_metrics

from torchtitan_lite.config import load_config
from torchtitan_lite.tools.memory import estimate_memory

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "estimate_memory.py"
MESH = {"fsdp4": "dp_shard 4", "tp2_fsdp2": "dp_shard 2 x tp 2", "pp2_fsdp2": "pp 2 x dp_shard 2",
        "pp2_tp2_looped_bfs": "pp 2 x tp 2", "cp2_fsdp2": "dp_shard 2 x cp 2", "moe_ep4": "dp_shard 4",
        "moe_e6_ep2_tp2": "dp_shard 2 x tp 2"}


@pytest.mark.parametrize("name", list(MESH))
def test_estimate_equals_the_trainers_held_bytes(runs, name, caplog):
    run = ALL_RUNS[name]
    first = read_metrics(runs[name])[0]
    assert first["step"] == 1
    cfg = load_config(["--job.config_file", str(TINY), *COMMON, "--training.steps", str(STEPS), *run.argv])
    with caplog.at_level(logging.INFO, logger="torchtitan_lite.tools.memory"):
        estimate = estimate_memory(cfg, run.nproc)
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        assert key in first, f"the trainer's step-1 record has no {key}: is metrics.held_bytes wired into train.py?"
        assert first[key] == getattr(estimate, key), key
    # Its progress: which rank and mesh it traces, then each piece as it starts.
    said = [r.getMessage() for r in caplog.records if r.name == "torchtitan_lite.tools.memory"]
    backward = r"backward, after \d+ micro-batch forwards of rank 0's stages" if run.dims.pp > 1 else "backward"
    expected = [re.escape(f"rank 0 of 4 (mesh {MESH[name]}): building and parallelizing its model on meta"),
                "materializing rank 0's shards as fake tensors",
                r"step 1 of 2 \(creates the optimizer state\): forward", backward, "step 1 of 2: optimizer step",
                r"step 2 of 2 \(measured\): forward", backward, "step 2 of 2: optimizer step"]
    assert len(said) == len(expected) and all(map(re.fullmatch, expected, said)), said


def test_the_script_shows_its_progress_on_stderr_and_the_table_on_stdout(capsys):
    spec = importlib.util.spec_from_file_location("estimate_memory_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--job.config_file", str(TINY), "--parallelism.tensor_parallel_degree", "2",
                        "--world_size", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("llama3 tiny (vocab ") and out.splitlines()[-1].startswith("  peak ")
    lines = err.splitlines()
    assert all(re.match(r"estimate_memory \[ *\d+\.\d s\]: ", line) for line in lines), err
    assert lines[0].endswith("rank 0 of 2 (mesh tp 2): building and parallelizing its model on meta")
    assert lines[-1].endswith(": done") and len(lines) == 9, err
    assert not script.progress.handlers  # removed again: a caller's own logging is left as it was
