"""benchmarks/gpu_report.py, run as CI runs it on a CPU (the tests' model on 2 processes, 4 steps, aot_eager), so the
script a GPU user runs first is never untested: every section is there, and the facts it reports hold."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import made_later
from launch import ROOT, TINY, command_env, run_job, tiny_model

from torchtitan_lite.config import load_config
from torchtitan_lite.parallel.dims import ParallelDims


def report_on_the_cpu(_: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_report.py"), "--config", str(TINY), "--nproc", "2",
           "--steps", "4", "--warmup", "1", "--backend", "aot_eager"]
    return run_job(cmd, command_env(), check=False)


made_later.register("gpu_report", report_on_the_cpu)


@pytest.mark.reads("gpu_report")
def test_gpu_report_on_the_cpu(made):
    proc = made("gpu_report")
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-3000:]
    for key in ("eager tokens/s", "compiled tokens/s", "eager MFU %", "compiled peak GiB", "estimated peak GiB"):
        assert re.search(rf"^{re.escape(key)}\s+[\d,.]+$", out, re.M), key
    assert "device syncs: steps that only train [0, 0, 0], a logging step 3" in out  # loss, grad norm, stop latch
    # FSDP 2 over a group per block and the root, each gathered in forward, each block but the last again in backward:
    # the rules of tests/multiprocess/test_collectives.py.
    blocks = tiny_model().n_layers
    assert re.search(rf"^\s+{2 * blocks} all_gather\s+world\s", out, re.M)
    assert re.search(rf"^\s+{blocks + 1} reduce_scatter\s+world\s", out, re.M)
    assert re.search(r"^compiled/eager tokens/s: \d+\.\d+$", out, re.M)


def test_collectives_are_named_by_the_mesh_dimension_they_run_over():
    """Rank 0's group on every dimension of the 5-D mesh (pp, dp_replicate, dp_shard, cp, tp), and FSDP's dp_shard x
    cp: a TP 2 x FSDP 2 label cannot hide a CP or PP layout's collectives among "2 ranks"."""
    from gpu_report import group_names  # noqa: PLC0415 - a script's function (pytest.ini puts benchmarks/ on the path)

    assert group_names(ParallelDims(1, 2, 2, 4)) == {(0, 2): "dp_shard", (0, 1): "tp", (0, 1, 2, 3): "world"}
    assert group_names(ParallelDims(1, 2, 1, 4, cp=2)) == {(0, 2): "dp_shard", (0, 1): "cp", (0, 1, 2, 3): "world"}
    assert group_names(ParallelDims(2, 2, 2, 32, pp=2, cp=2)) == {
        (0, 16): "pp", (0, 8): "dp_replicate", (0, 4): "dp_shard", (0, 2): "cp", (0, 1): "tp",
        (0, 2, 4, 6): "dp_shard x cp", tuple(range(32)): "world"}


def test_torchtitans_float8_figure_is_printed_for_the_float8_config_alone():
    """Their compiled float8 row (8,532 tokens/s, no eager figure, no MFU) for the 8B config on 8 GPUs with float8
    tensorwise; their bf16 rows without float8; nothing for another recipe or world size. The header names it."""
    from gpu_report import float8_summary, published  # noqa: PLC0415 - a script's functions

    base = ["--job.config_file", str(ROOT / "train_configs" / "llama3_8b.toml"), "--training.local_batch_size", "2"]
    f8 = [*base, "--float8.enable_float8_linear"]
    assert published(load_config(base), 8)["compiled tokens/s"] == 6667
    assert {k: v for k, v in published(load_config(f8), 8).items() if k != "source"} == {
        "compiled tokens/s": 8532, "compiled peak GiB": 76.8}
    assert published(load_config([*f8, "--float8.recipe_name", "rowwise"]), 8) is None
    assert published(load_config(f8), 16) is None
    assert float8_summary(load_config(base), fsdp=True) == ""
    gathered = load_config([*f8, "--float8.enable_fsdp_float8_all_gather"])
    assert float8_summary(gathered, fsdp=True) == ", float8 tensorwise, float8 all-gather"
    assert float8_summary(gathered, fsdp=False) == ", float8 tensorwise"
