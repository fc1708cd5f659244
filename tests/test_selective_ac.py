"""Op-level selective activation checkpointing (parallel/selective_ac.py) in one process: what its policy keeps, and
a block holding an FSDP unit of its own, whose hooks torch 2.13's replay of the block's ops would otherwise refuse
(tests/multiprocess: expert parallelism and TP with it, against the runs without it)."""

from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import CheckpointPolicy

from torchtitan_lite.parallel import selective_ac

SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def test_the_policy_keeps_the_collectives_and_copies_to_the_host():
    """The EP all-to-alls and TP's reduce-scatters (a recompute would run them again in backward), and a copy from a
    device to the host (the split sizes' read: a recompute would wait for the device again); a meta tensor stands in
    for a GPU's."""
    policy = selective_ac.policy_keeping((torch.ops.aten.mm.default, *selective_ac.COLLECTIVES))
    x = torch.empty(4, device="meta")
    assert policy(None, torch.ops._c10d_functional.all_to_all_single.default, x, [2, 2], [2, 2], "0") == SAVE
    assert policy(None, torch.ops._c10d_functional.reduce_scatter_tensor.default, x, "sum", 2, "0") == SAVE
    assert policy(None, torch.ops.aten._to_copy.default, x, device=torch.device("cpu")) == SAVE
    assert policy(None, torch.ops.aten._to_copy.default, x, dtype=torch.bfloat16) == RECOMPUTE  # stays there
    assert policy(None, torch.ops.aten._to_copy.default, torch.empty(4), device="cpu") == RECOMPUTE  # host to host
    assert policy(None, torch.ops.aten.add.Tensor, x, x) == RECOMPUTE


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.outer, self.inner = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return x + self.inner(torch.relu(self.outer(x))).sin()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": Block(), "1": Block()})

    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    def forward(self, x):
        for block in self.blocks():
            x = block(x)
        return x


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def grads(mesh, checkpointed: bool, uncounted: bool) -> list[torch.Tensor]:
    """Every parameter's gradient of a step of two blocks, each an FSDP unit holding one of its own (`inner`, as the
    experts under EP), op-level checkpointed or not."""
    torch.manual_seed(0)
    model = Model()
    for name, block in list(model.layers.items()):
        if checkpointed:
            context = partial(selective_ac.contexts, selective_ac.policy_keeping((torch.ops.aten.mm.default,)))
            model.layers[name] = block = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context)
        fully_shard(getattr(block, "_checkpoint_wrapped_module", block).inner, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if uncounted:
        selective_ac.uncount_inner_units(model.blocks())
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    return [p.grad.to_local() for p in model.parameters()]


def test_a_block_holding_an_fsdp_unit_of_its_own_recomputes_as_it_computed(mesh):
    """The inner unit gathers its weight and frees it in forward, and gathers it for backward in the recompute:
    counted, its hooks' ops differ from the forward's and torch refuses the replay; uncounted, the step's gradients
    are the uncheckpointed step's bits."""
    with pytest.raises(RuntimeError, match="encountered during backward but not found in storage"):
        grads(mesh, checkpointed=True, uncounted=False)
    plain = grads(mesh, checkpointed=False, uncounted=False)
    assert all(torch.equal(a, b) for a, b in zip(grads(mesh, checkpointed=True, uncounted=True), plain, strict=True))
