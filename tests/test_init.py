"""The initializer gives every element a value that depends only on (key, global index): any split of a tensor
into blocks, filled separately, reassembles into the same full tensor."""

import math
from statistics import NormalDist

import pytest
import torch

from torchtitan_lite.init import fill_block_, trunc_normal_, uniform


def full(shape, key="0/w", std=0.02, cutoff=math.inf):
    t = torch.empty(shape)
    trunc_normal_(t, std, cutoff, key)
    return t


@pytest.mark.parametrize("layout", ["rows", "cols", "grid", "uneven"])
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


def test_values_do_not_depend_on_thread_count_or_chunking():
    ref = full((300, 50))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(full((300, 50)), ref)
    finally:
        torch.set_num_threads(threads)
    import torchtitan_lite.init as init
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
