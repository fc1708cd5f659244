"""The initializer gives every element a value that depends only on (key, global index): any split of a tensor
into blocks, filled separately, reassembles into the same full tensor; and both fast paths, the host's fused kernel
(init_fill.c) and the tensor ops of accelerators, give exactly the values of the plain definition kept below."""

import logging
import math
import os
from statistics import NormalDist

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

import torchtitan_lite.models.init as init
import torchtitan_lite.models.init_cpu as init_cpu
from torchtitan_lite.models.init import _quantile_table, _tables, fill_block_, trunc_normal_, uniform


# The definition of the values, as the first implementation computed them (int64 hash, searchsorted, one call per
# block): slow and plain, the reference every fast path must match bit for bit.
def ref_mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def ref_uniform(index, key):
    k = init.key_words(key)
    lo, hi = index & 0xFFFFFFFF, index >> 32
    a = ref_mix32(ref_mix32(lo ^ k[0]) ^ hi ^ k[1])
    b = ref_mix32(ref_mix32(lo ^ k[2]) ^ hi ^ k[3])
    return ((a >> 6) * (1 << 27) + (b >> 5)).to(torch.float64) * 2.0**-53


def ref_bin(u, cutoff):
    p = torch.tensor(_quantile_table(min(float(cutoff), 8.0))[1], dtype=torch.float64)
    return (torch.searchsorted(p, u, right=True) - 1).clamp_(0, 4095)


def ref_normal(u, cutoff):
    z_list, p_list = _quantile_table(min(float(cutoff), 8.0))
    z, p = torch.tensor(z_list, dtype=torch.float64), torch.tensor(p_list, dtype=torch.float64)
    j = ref_bin(u, cutoff)
    p0, p1, z0 = p[j], p[j + 1], z[j]
    frac = (u - p0) / (p1 - p0).clamp_min(1e-300)
    return z0 + frac * (z[j + 1] - z0)


def ref_block(shape, full_shape, offset, std, cutoff, key, dtype=torch.float32):
    strides = [math.prod(full_shape[d + 1:]) for d in range(len(full_shape))]
    index = torch.zeros((), dtype=torch.int64)
    for d in range(len(shape)):
        index = index.unsqueeze(-1) + (torch.arange(shape[d]) + offset[d]) * strides[d]
    return (ref_normal(ref_uniform(index, key), cutoff) * std).to(dtype)


@pytest.fixture(params=["kernel", "tensor ops"])
def fill_path(request, monkeypatch):
    """Each test that uses it runs on the host's kernel, then on the tensor ops (the accelerators' path)."""
    if request.param == "tensor ops":
        monkeypatch.setattr(init_cpu, "kernel", lambda: None)
    else:
        assert init_cpu.kernel() is not None, "no C compiler: the kernel's tests would test the tensor ops twice"
    return request.param


def full(shape, key="0/w", std=0.02, cutoff=math.inf):
    t = torch.empty(shape)
    trunc_normal_(t, std, cutoff, key)
    return t


@pytest.mark.parametrize("layout", ["rows", "cols", "grid", "uneven"])
@pytest.mark.usefixtures("fill_path")
def test_blocks_reassemble_to_the_full_tensor(layout):
    shape = (37, 24)
    ref = full(shape)
    out = torch.full(shape, float("nan"))
    cuts = {"rows": ([0, 10, 20, 37], [0, 24]), "cols": ([0, 37], [0, 6, 12, 18, 24]),
            "grid": ([0, 19, 37], [0, 12, 24]), "uneven": ([0, 1, 2, 30, 37], [0, 5, 24])}[layout]
    for r0, r1 in zip(cuts[0], cuts[0][1:]):
        for c0, c1 in zip(cuts[1], cuts[1][1:]):
            block = torch.empty(r1 - r0, c1 - c0)
            fill_block_(block, shape, (r0, c0), 0.02, math.inf, "0/w")
            out[r0:r1, c0:c1] = block
    assert torch.equal(out, ref)


@pytest.mark.usefixtures("fill_path")
def test_values_do_not_depend_on_thread_count_or_chunking():
    ref = full((300, 50))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(full((300, 50)), ref)
    finally:
        torch.set_num_threads(threads)
    chunk, init._CHUNK = init._CHUNK, 7  # forces one row per chunk
    try:
        assert torch.equal(full((300, 50)), ref)
    finally:
        init._CHUNK = chunk


def test_keys_and_shapes_matter():
    a, b = full((64, 64), key="0/a"), full((64, 64), key="1/a")
    assert not torch.equal(a, b)
    # A 1-D tensor of the same numel holds the same flat sequence: values are a function of the flat index.
    assert torch.equal(full((64 * 64,), key="0/a").view(64, 64), a)


def test_distribution_is_the_truncated_normal():
    x = full((400_000,), std=1.0, cutoff=3.0).double()
    assert x.abs().max() <= 3.0
    trunc = NormalDist().cdf(3.0) - NormalDist().cdf(-3.0)
    for q in (-2.0, -1.0, -0.3, 0.0, 0.5, 1.5, 2.5):
        expected = (NormalDist().cdf(q) - NormalDist().cdf(-3.0)) / trunc
        assert abs((x <= q).double().mean().item() - expected) < 3e-3, q
    y = full((400_000,), std=0.02)  # "untruncated": std 0.02 within 1%
    assert abs(y.std().item() - 0.02) < 2e-4 and abs(y.mean().item()) < 2e-4


def test_uniform_is_uniform_and_uses_the_high_index_bits():
    u = uniform(torch.arange(200_000), "k")
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 3e-3
    hi = uniform(torch.arange(1000) + (1 << 33), "k")
    assert not torch.equal(hi, u[:1000])


@pytest.mark.parametrize("seed", [0, 90125])
@pytest.mark.parametrize("cutoff", [math.inf, 3.0, 1 / 3])  # 1/3: uneven knots, a dz per bin
@pytest.mark.usefixtures("fill_path")
def test_blocks_are_the_definition_bit_for_bit(seed, cutoff):
    # Uneven blocks of 2-D and 3-D tensors, a scalar, and low-precision storage: each is the reference's values.
    # float64 storage shows the computation's own rounding, which float32's final rounding would almost always hide.
    cases = [((37, 24), (37, 24), (0, 0)), ((19, 5), (37, 24), (18, 19)), ((1, 7), (37, 24), (36, 0)),
             ((3, 4, 5), (7, 9, 11), (2, 3, 4)), ((), (), ()), ((1000,), (1000,), (0,))]
    for shape, full_shape, offset in cases:
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            block = torch.full(shape, float("nan"), dtype=dtype)
            fill_block_(block, full_shape, offset, 0.02, cutoff, f"{seed}/w")
            assert torch.equal(block, ref_block(shape, full_shape, offset, 0.02, cutoff, f"{seed}/w", dtype)), shape
    # Enough draws to land in every bin of the table, std 1 so none is lost to rounding.
    block = torch.empty(512, 512, dtype=torch.float64)
    fill_block_(block, (1024, 512), (512, 0), 1.0, cutoff, f"{seed}/many")
    ref = ref_block((512, 512), (1024, 512), (512, 0), 1.0, cutoff, f"{seed}/many", torch.float64)
    assert torch.equal(block, ref)


@pytest.mark.usefixtures("fill_path")
def test_indices_beyond_int32_are_the_definition():
    # Tensors of more than 2**31 elements hash the high word of the index too: blocks around 2**31 and 2**32.
    for offset in (2**31 - 50, 2**32 - 50, 2**33 - 200):
        block = torch.empty(100)
        fill_block_(block, (2**34,), (offset,), 0.02, math.inf, "0/huge")
        assert torch.equal(block, ref_block((100,), (2**34,), (offset,), 0.02, math.inf, "0/huge")), offset


@pytest.mark.usefixtures("fill_path")
def test_tensor_subclasses_are_filled_through_their_ops():
    # A wrapper subclass's memory is not where its values live (torchao's float8 weights are such a wrapper under
    # FSDP's float8 all-gather): the fill must go through its ops, here to both of TwoTensor's inner tensors.
    from torch.testing._internal.two_tensor import TwoTensor

    block = TwoTensor(torch.empty(40, 30), torch.empty(40, 30))
    fill_block_(block, (80, 30), (40, 0), 0.02, math.inf, "0/w")
    ref = ref_block((40, 30), (80, 30), (40, 0), 0.02, math.inf, "0/w")
    assert torch.equal(block.a, ref) and torch.equal(block.b, ref)


def knot_edges(cutoff, slot_edges):
    """u * 2**53 (integers U) at every knot of the table and every slot edge, and one step (2**-53) either side."""
    points = torch.cat([torch.tensor(_quantile_table(min(float(cutoff), 8.0))[1], dtype=torch.float64), slot_edges])
    points = points * 2.0**53
    U = torch.cat([points.floor() + d for d in (-1, 0, 1)] + [points.ceil()])
    return U[(U >= 0) & (U < 2.0**53)].to(torch.int64).unique()


@pytest.mark.parametrize("cutoff", [math.inf, 3.0, 1 / 3])
def test_kernel_is_the_definition_at_every_knot_and_slot_edge(cutoff):
    # The kernel's lookup starts from the bin of u's 2**-16-wide slot and steps over the knots up to u: its hard
    # cases are u exactly at a knot or a slot edge, and one step either side. std 1 and float64 output show the
    # interpolation's own rounding.
    U = knot_edges(cutoff, torch.arange(1 << 16, dtype=torch.float64) * 2.0**-16)
    u = U.to(torch.float64) * 2.0**-53
    out = torch.empty_like(u)
    init_cpu.quantiles_(out, u, 1.0, init._host_tables(min(float(cutoff), 8.0)))
    assert torch.equal(out, ref_normal(u, cutoff))


def test_kernel_builds_without_native_flags_and_falls_back_without_a_compiler(tmp_path, monkeypatch, caplog):
    # A compiler that refuses -march=native still builds the kernel (the portable flags), which gives the same
    # values; with no compiler at all, one warning, and the tensor ops fill with the same values again.
    # Patched in this module, not in the environment, which the suite's background jobs copy when they start.
    monkeypatch.setattr(init_cpu, "cache_dir", lambda: tmp_path / "cache")
    picky = tmp_path / "picky-cc"
    picky.write_text('#!/bin/sh\ncase "$*" in *-march=native*) echo "unknown flag" >&2; exit 1;; esac\n'
                     'exec cc "$@"\n')
    picky.chmod(0o755)
    ref = ref_block((40, 30), (80, 30), (40, 0), 0.02, math.inf, "0/w", torch.float64)
    for compiler, built in ((str(picky), True), (str(tmp_path / "no-such-cc"), False)):
        monkeypatch.setattr(init_cpu, "_compiler", lambda: compiler)
        init_cpu.kernel.cache_clear()
        try:
            with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
                assert (init_cpu.kernel() is not None) == built
            block = torch.empty(40, 30, dtype=torch.float64)
            fill_block_(block, (80, 30), (40, 0), 0.02, math.inf, "0/w")
            assert torch.equal(block, ref), compiler
        finally:
            init_cpu.kernel.cache_clear()
    assert len(os.listdir(tmp_path / "cache" / "kernels")) == 1  # the picky compiler's, under a name of its own
    assert [r.message.split(";")[0] for r in caplog.records] == [
        f"init: the host's fused fill could not be built ({tmp_path / 'no-such-cc'}: not found)"]


@pytest.mark.parametrize("cutoff", [math.inf, 3.0, 1 / 3])
def test_bin_lookup_is_searchsorted_at_every_knot_and_bucket_edge(cutoff):
    # The lookup's hard cases: u exactly at a knot, one step (2**-53) either side, and at the ends of every bucket,
    # where the lookup changes row; the far-end buckets are searched. u * 2**53 is an integer U; the bucket comes from
    # U's top 26 bits, as the signed int32 the hash leaves.
    U = knot_edges(cutoff, init._bucket_ranges()[0])
    n = len(U)
    high = ((U >> 27) - ((U >> 52) << 26)).to(torch.int32)
    bucket, j = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
    init._bucket_(high, torch.empty(n), torch.empty(n, dtype=torch.float16), bucket, torch.tensor(2.0**-10))
    table = _tables(min(float(cutoff), 8.0), torch.device("cpu"))
    init._bin_(j, bucket, U.to(torch.float64), table, torch.empty(n, dtype=torch.float64), torch.empty_like(j))
    assert torch.equal(j.long(), ref_bin(U.to(torch.float64) * 2.0**-53, cutoff))


@pytest.mark.usefixtures("fill_path")
def test_sharded_parameters_are_the_definition():
    # DTensors built in this process on a fake 4-process mesh: FSDP over TP (a _StridedShard over Shard) and a
    # TP row-wise Shard(1), with uneven shards; each rank's local shard is the full reference tensor's block.
    full = (37, 10)
    ref = ref_block(full, full, (0, 0), 0.02, math.inf, "3/w")
    layouts = [(_StridedShard(0, split_factor=2), Shard(0)), (Shard(0), Shard(1))]
    for placements in layouts:
        for rank in range(4):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
            try:
                mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
                shape, offset = compute_local_shape_and_global_offset(full, mesh, placements)
                param = DTensor.from_local(torch.empty(shape), mesh, placements, shape=torch.Size(full),
                                           stride=(10, 1), run_check=False)
                trunc_normal_(param, 0.02, math.inf, "3/w")
                block = ref[offset[0]:offset[0] + shape[0], offset[1]:offset[1] + shape[1]]
                assert torch.equal(param.to_local(), block), (placements, rank)
            finally:
                dist.destroy_process_group()
