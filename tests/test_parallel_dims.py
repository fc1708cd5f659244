from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan_lite.config import ConfigError, Parallelism
from torchtitan_lite.models.llama3.model import FLAVORS
from torchtitan_lite.models.common.parallelize import tp_sizes
from torchtitan_lite.parallel.dims import DIMS, ParallelDims


def dims(world, replicate=1, shard=-1, tp=1):
    return ParallelDims.from_config(Parallelism(data_parallel_replicate_degree=replicate,
                                                data_parallel_shard_degree=shard, tensor_parallel_degree=tp), world)


def test_shard_minus_one_takes_the_rest():
    d = dims(8, replicate=2, tp=2)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.dp, d.fsdp) == (2, 2, 2, 4, True)
    assert not dims(2, tp=2).fsdp


@pytest.mark.parametrize("kw", [dict(tp=3), dict(replicate=2, shard=4), dict(shard=3)])
def test_degrees_must_multiply_to_world_size(kw):
    with pytest.raises(ConfigError, match="world size (is )?4"):
        dims(4, **kw)


def test_tp_must_divide_heads_and_ffn():
    args = FLAVORS["debugmodel"].with_(vocab_size=258)
    dims(4, tp=4).validate_model(tp_sizes(args))
    with pytest.raises(ConfigError, match="n_heads = 16 .*tensor_parallel_degree = 32"):
        ParallelDims(1, 1, 32, 32).validate_model(tp_sizes(args))
    with pytest.raises(ConfigError, match="n_kv_heads = 8"):
        ParallelDims(1, 1, 16, 16).validate_model(tp_sizes(FLAVORS["8B"].with_(vocab_size=8)))


def test_hpz_group_must_divide_the_shard_degree():
    hpz = lambda group, **kw: ParallelDims.from_config(  # noqa: E731
        Parallelism(fsdp_reshard_after_forward=group, **kw), 8)
    assert hpz("4").dp_shard == 8
    with pytest.raises(ConfigError, match="fsdp_reshard_after_forward = 3 must divide the FSDP shard degree 8: "
                                          "choose one of 1, 2, 4, 8"):
        hpz("3")
    with pytest.raises(ConfigError, match="shard degree 4"):
        hpz("8", tensor_parallel_degree=2)


def test_pinned_offload_is_refused_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    offload = Parallelism(fsdp_cpu_offload=True)
    with pytest.raises(ConfigError, match="--no-parallelism.fsdp_offload_pin_memory"):
        ParallelDims.from_config(offload, 2)
    offload.fsdp_offload_pin_memory = False
    assert ParallelDims.from_config(offload, 2).fsdp


def test_global_batch_is_kept_across_world_sizes_and_a_size_that_cannot_hold_it_names_those_that_can():
    # An elastic job keeps global batch 8 of micro-batches of 2: 4 on 1 rank, 2 on 2, 1 on 4.
    assert [dims(w).global_batch(2, 8) for w in (1, 2, 4)] == [8, 8, 8]
    assert dims(3).global_batch(2, -1) == 6
    with pytest.raises(ConfigError, match=r"8 is not a multiple of local_batch_size 2 x data-parallel degree 3: use "
                                          r"a multiple of 6, or a world size of 1, 2, 4$"):
        dims(3).global_batch(2, 8)
    with pytest.raises(ConfigError, match="or a world size of 4, 8, 16$"):  # TP 2, 2 replicas: even dp degrees
        dims(12, replicate=2, tp=2).global_batch(2, 16)


@pytest.mark.parametrize("degrees", [(2, 1, 2, 1, 2), (1, 2, 1, 1, 4), (1, 1, 2, 2, 2), (2, 2, 1, 2, 1),
                                     (1, 1, 1, 1, 8), (1, 1, 8, 1, 1)])
@pytest.mark.parametrize("rank", [0, 5])
def test_degree_one_dims_make_no_groups_and_every_dim_still_has_its_ranks(degrees, rank):
    """On a fake 8-rank world (one process playing `rank`): a dim of degree 1 costs no new_group call per rank of
    the world, at most one local call for this rank's own group; every dim, "dp" and "loss" still hold the ranks
    (and this rank's local rank) that slicing the full grid gives."""
    pp, replicate, shard, cp, tp = degrees
    grid = torch.arange(8).view(degrees)
    coord = (grid == rank).nonzero()[0].tolist()

    def expected(names):  # the ranks that share this rank's coordinates outside `names`, in grid order
        return grid[tuple(slice(None) if n in names else c for n, c in zip(DIMS, coord))].flatten().tolist()

    calls = []
    real = c10d._new_group_with_tag
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    try:
        with mock.patch.object(c10d, "_new_group_with_tag",
                               lambda ranks=None, *a, **kw: calls.append((ranks, kw)) or real(ranks, *a, **kw)):
            mesh, dp_mesh, loss_mesh = ParallelDims(replicate, shard, tp, 8, pp, cp).build_mesh("cpu")
        singles = [kw.get("use_local_synchronization", False) for ranks, kw in calls if len(ranks) == 1]
        assert singles in ([], [True])
        assert mesh.mesh_dim_names == DIMS and tuple(mesh.shape) == degrees
        loss_dims = ("pp", "dp_replicate", "dp_shard", "cp") if pp * cp > 1 else ("dp_replicate", "dp_shard")
        for m, names in [*((mesh[n], (n,)) for n in DIMS), (dp_mesh, ("dp_replicate", "dp_shard")),
                         (loss_mesh, loss_dims)]:
            ranks = dist.get_process_group_ranks(m.get_group())
            assert sorted(ranks) == expected(names), names
            assert m.get_local_rank() == expected(names).index(rank), names
    finally:
        dist.destroy_process_group()
