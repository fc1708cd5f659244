"""How many process groups ParallelDims.build_mesh asks for, and how long it takes, at the scale of big jobs.

    python benchmarks/mesh_build.py

One process plays rank 0 of each job on torch's fake backend (no communication), so a 16,384-rank mesh builds on a
laptop. Counted: `new_group` calls (every rank makes one per subgroup of every dimension, its own or not: the
Python-side cost that grows with the world) and the groups this rank joins (each a real communicator, or a gloo
context rendezvousing through the store, on a real job). The time is build_mesh plus the FSDP mesh, on the fake
backend: a lower bound, since a real group's rendezvous costs more than a fake one.
"""

import time
from unittest import mock

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan_lite.parallel.dims import ParallelDims

JOBS = {  # name: (pp, dp_replicate, dp_shard, cp, tp)
    "405B, PP 8 x FSDP 8 x TP 8": (8, 1, 8, 1, 8),
    "PP 16 x FSDP 128 x TP 8": (16, 1, 128, 1, 8),
}


def measure(pp: int, replicate: int, shard: int, cp: int, tp: int) -> tuple[int, int, int, float]:
    """(world size, new_group calls, groups rank 0 joined, seconds) of one mesh build."""
    world = pp * replicate * shard * cp * tp
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        calls, joined = 0, len(c10d._world.pg_map)
        real = c10d._new_group_with_tag

        def counted(*args, **kwargs):
            nonlocal calls
            calls += 1
            return real(*args, **kwargs)

        dims = ParallelDims(replicate, shard, tp, world, pp, cp)
        with mock.patch.object(c10d, "_new_group_with_tag", counted):
            start = time.perf_counter()
            mesh, _, _ = dims.build_mesh("cpu")
            dims.fsdp_mesh(mesh)
            seconds = time.perf_counter() - start
        return world, calls, len(c10d._world.pg_map) - joined, seconds
    finally:
        dist.destroy_process_group()


def main() -> None:
    for name, degrees in JOBS.items():
        world, calls, groups, seconds = measure(*degrees)
        print(f"{name} ({world} ranks): {calls} new_group calls, rank 0 joins {groups} groups, {seconds:.3f} s")
    print(f"mesh build at {world} ranks: {calls} new_group calls, {groups} groups, {seconds:.3f} s")


if __name__ == "__main__":
    main()
