"""Initial weights are bit-identical on every mesh, with no seed checkpoint (real torchrun processes)."""

import os
import subprocess
import sys

import pytest
import torch

from launch import ROOT, TINY
from torchtitan_lite.model import FLAVORS, Transformer


def single_process_weights(seed: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = Transformer(FLAVORS["debugmodel"].with_(vocab_size=258, max_seq_len=64))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", [
    ["--parallelism.tensor_parallel_degree", "2"],  # FSDP over TP: a _StridedShard on dim 0
    ["--parallelism.tensor_parallel_degree", "4"],
    ["--parallelism.data_parallel_replicate_degree", "2"],  # HSDP
])
def test_full_parameters_match_single_process(tmp_path, layout):
    out = tmp_path / "init.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "tests/multiprocess/dump_init.py"), str(out), "--job.config_file", str(TINY), *layout]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, ref = torch.load(out, weights_only=True), single_process_weights(seed=7)  # tiny.toml's seed
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
