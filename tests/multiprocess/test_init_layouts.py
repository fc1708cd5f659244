"""Initial weights are bit-identical on every mesh, with no seed checkpoint (real torchrun processes)."""

import json

import pytest
import torch

import probes
from launch import TINY, tiny_model
from torchtitan_lite.models.llama3.model import Transformer

pytestmark = pytest.mark.reads("probes")

LAYOUTS = {
    "tp2_fsdp2": ["--parallelism.tensor_parallel_degree", "2"],  # FSDP over TP: a _StridedShard on dim 0
    "tp4": ["--parallelism.tensor_parallel_degree", "4"],
    "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2"],
    # FSDP over dp_shard x cp flattened: the cp ranks hold shards of one model, not copies.
    "cp2_fsdp2": ["--parallelism.context_parallel_degree", "2"],
}


# The full initial parameters of every layout, all built in one 4-process launch (probes.py's, dump_init.py).
probes.register("init", str(TINY), json.dumps(LAYOUTS))


@pytest.fixture(scope="module")
def dumped(probed):
    return probed / "init"


def single_process_weights(seed: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = Transformer(tiny_model())
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_full_parameters_match_single_process(dumped, layout):
    got, ref = torch.load(dumped / f"{layout}.pt", weights_only=True), single_process_weights(seed=7)  # tiny's seed
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
