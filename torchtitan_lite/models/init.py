"""Layout-invariant random initialization.

A parameter's initial value must not depend on how it is sharded: 1 process, FSDP 8 and TP 2 x FSDP 4 must start
from the same full tensors, or their loss curves part at step 1. torch's generators cannot promise that (DTensor's
random ops are not layout-consistent on the CPU, and a sharded parameter never exists whole), so every element is
computed from (seed, parameter name, global element index) alone, by a counter-based generator evaluated only on the
local shard: O(shard) memory and time, no communication.

Bitwise equality also needs every operation to round the same way wherever an element lands in a kernel's
vectorized body or scalar tail. So the generator uses only integer ops, comparisons and IEEE-exact float64
+ - * /; the normal quantile comes from a table computed once in Python scalars, not from erfinv or log
(whose vectorized and scalar code paths differ in the last bit on the CPU).

Host initialization (CPU offload: every rank fills its shard on the CPU) makes its speed matter, so a shard is
filled in bulk, a few whole-tensor ops per element instead of a binary search each: the hash runs on int32 lanes,
both of uniform()'s streams in one tensor, and a draw's bin comes from a lookup (buckets as fine as the bins, found
from the float32 exponent of the draw's distance to the nearer end of [0, 1)) and one comparison. The values are the
plain definition's, uniform() then a search of the table, bit for bit: tests/test_init.py keeps that definition to
compare against, and benchmarks/init_speed.py times both against torch's `normal_`.
"""

from __future__ import annotations

import functools
import hashlib
import math
from statistics import NormalDist

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

_MASK32 = 0xFFFFFFFF
_TABLE_SIZE = 4096  # bins of the quantile table; each holds 1/4096 of [-cutoff, cutoff] in units of std
_MAX_CUTOFF = 8.0  # beyond 8 std the normal holds 1e-15 of its mass: "untruncated" for all purposes
_OCTAVE_BITS = 10  # buckets of the bin lookup: 2**10 per octave of a draw's distance to the nearer end of [0, 1)
_OCTAVES = 24  # octaves of (that distance * 2**25) resolved: 2**-25 .. 2**-1
_CHUNK = 1 << 16  # elements generated at once per CPU thread: temporaries stay in cache, Python calls stay few
_CHUNK_ACCELERATOR = 1 << 22  # where every op is a kernel launch


def mix32(x):
    """A 32-bit integer hash, on int64 tensors or Python ints below 2**32."""
    # A 32-bit integer hash (C. Wellons' hash-prospector family). Both multipliers are < 2**31, so with x < 2**32
    # every product fits in a signed int64 and no op ever overflows.
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def key_words(key: str) -> list[int]:
    """Four 32-bit words derived from a string key (stable across processes, unlike hash())."""
    digest = hashlib.sha256(key.encode()).digest()
    return [int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(4)]


def uniform(index: torch.Tensor, key: str) -> torch.Tensor:
    """float64 values in [0, 1) with 53 random bits, a pure function of (key, index)."""
    k = key_words(key)
    lo, hi = index & _MASK32, index >> 32
    a = mix32(mix32(lo ^ k[0]) ^ hi ^ k[1])
    b = mix32(mix32(lo ^ k[2]) ^ hi ^ k[3])
    return ((a >> 6) * (1 << 27) + (b >> 5)).to(torch.float64) * 2.0**-53


@functools.lru_cache(maxsize=16)
def _quantile_table(cutoff: float) -> tuple[list[float], list[float]]:
    # Knots evenly spaced in z, with their truncated-normal CDF: interpolating between them gives a density that is
    # constant on each 2*cutoff/4096-wide bin, accurate in the tails too (unlike knots evenly spaced in probability).
    z = [-cutoff + 2 * cutoff * j / _TABLE_SIZE for j in range(_TABLE_SIZE + 1)]
    cdf = [NormalDist().cdf(v) for v in z]
    p = [(c - cdf[0]) / (cdf[-1] - cdf[0]) for c in cdf]
    return z, p


def _bucket(a: torch.Tensor) -> torch.Tensor:
    """The lookup bucket of each draw, from its a (int32): the octave and 10 more top bits of u's distance to the
    nearer end of [0, 1), read off a float32's exponent and mantissa; the far half's buckets follow the near half's.
    Buckets narrow towards the ends as the bins of the quantile table do, so that nearly all hold at most one knot."""
    side = a >> 31  # 0 where u < 1/2, else -1
    distance = a ^ side  # a, or 2**32 - 1 - a: the top 32 bits of u's distance to 0 or to 1, below 2**31
    distance >>= 7
    distance.clamp_min_(1)  # below 2**24, so exact in float32: its exponent is the octave
    bucket = distance.to(torch.float32).view(torch.int32)
    bucket >>= 23 - _OCTAVE_BITS
    bucket.add_(side, alpha=-(_OCTAVES << _OCTAVE_BITS))
    bucket -= 127 << _OCTAVE_BITS  # 1.0's exponent
    return bucket


def _bucket_ranges() -> tuple[torch.Tensor, torch.Tensor]:
    """[lower, upper) of the u in each of _bucket's buckets: what _bucket does, undone."""
    index = torch.arange(_OCTAVES << _OCTAVE_BITS)
    octave, step = index >> _OCTAVE_BITS, index & ((1 << _OCTAVE_BITS) - 1)

    def least(step):  # the least distance >> 7 in (octave, step): 2**octave * (1 + step / 2**10), rounded up
        return (1 << octave) + (((step << octave) + (1 << _OCTAVE_BITS) - 1) >> _OCTAVE_BITS)

    near, far = least(step) << 7, least(step + 1) << 7
    near[0] = 0  # clamp_min_(1) puts distances 0 .. 127 in bucket 0
    lower = torch.cat([near, (1 << 32) - far]).to(torch.float64) * 2.0**-32
    upper = torch.cat([far, (1 << 32) - near]).to(torch.float64) * 2.0**-32
    return lower, upper


@functools.lru_cache(maxsize=16)
def _tables(cutoff: float, device: torch.device) -> dict[str, torch.Tensor]:
    """The quantile table as _normal_at_ reads it: one column per bin quantity, and the lookup of a draw's bin."""
    z_list, p_list = _quantile_table(cutoff)
    z = torch.tensor(z_list, dtype=torch.float64)
    p = torch.tensor(p_list, dtype=torch.float64)
    # The knots' p are kept times 2**53, as the draws' u are (exact: a power of two).
    # With p[0] == 0 <= u < 1 == p[-1] and p sorted, the bin of u, clamp(searchsorted(p, u, right=True) - 1, 0, 4095),
    # is the number of p[1:] <= u: a count, which a lookup and one comparison can make.
    assert p[0] == 0 and p[-1] == 1 and bool((p[1:] >= p[:-1]).all())
    # When the bins of a bucket's two ends differ by at most one, the bucket holds at most one knot: a u inside is in
    # the lower bin, or in the next one when u >= that knot. Buckets holding more knots (at the very ends, where the
    # bins are finer than 2**-25: a few draws in a million) are flagged by + _TABLE_SIZE, and their draws searched.
    lower, upper = (torch.searchsorted(p, u, right=True).sub_(1).clamp_(0, _TABLE_SIZE - 1) for u in _bucket_ranges())
    one_knot = upper - lower <= 1
    dz = z[1:] - z[:-1]
    columns = {
        "bin": torch.where(one_knot, lower, lower + _TABLE_SIZE).to(torch.int32),
        "knot": torch.where(one_knot, p[lower + 1], math.inf) * 2.0**53,
        "p_upper": p[1:] * 2.0**53,
        "p": p[:-1] * 2.0**53,
        "dp": (p[1:] - p[:-1]).clamp_min(1e-300) * 2.0**53,
        "z": z[:-1],
        "dz": dz[:1] if bool((dz == dz[0]).all()) else dz,  # one value for exactly even knots (cutoffs 8 and 3)
        # uniform()'s a >> 6 and b >> 5, as logical shifts of the int32 rows holding a and b
        "shift": torch.tensor([[6], [5]], dtype=torch.int32),
        "mask": torch.tensor([[(1 << 26) - 1], [(1 << 27) - 1]], dtype=torch.int32),
    }
    return {name: c.contiguous().to(device) for name, c in columns.items()}


def _xorshift_(x: torch.Tensor, tmp: torch.Tensor, shift: int) -> None:
    torch.bitwise_right_shift(x, shift, out=tmp)
    tmp &= (1 << (32 - shift)) - 1  # >> is arithmetic on int32: the mask makes it logical
    x ^= tmp


def _mix32_(x: torch.Tensor, tmp: torch.Tensor, xorshifted: bool = False) -> None:
    """mix32 in place on int32 lanes, where a multiply wraps as the uint32 one does. `xorshifted`: x has had mix32's
    first step, x ^= x >> 16, already."""
    if not xorshifted:
        _xorshift_(x, tmp, 16)
    x *= 0x21F0AAAD  # both multipliers are < 2**31: int32 scalars
    _xorshift_(x, tmp, 15)
    x *= 0x735A2D97
    _xorshift_(x, tmp, 15)


def _bin(a: torch.Tensor, u: torch.Tensor, table: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bin of each draw (its a, and its u times 2**53), as searchsorted finds it: by its bucket's lower bin, plus
    one when u is past the bucket's knot."""
    bucket = _bucket(a)
    j = torch.index_select(table["bin"], 0, bucket)
    j += torch.index_select(table["knot"], 0, bucket) <= u
    if j.max() >= _TABLE_SIZE:
        far = (j >> 12).nonzero().squeeze(1)
        j[far] = torch.searchsorted(table["p_upper"], u[far], right=True, out_int32=True)
    return j


def _normal_at_(out: torch.Tensor, index: torch.Tensor, key: str, cutoff: float, std: float) -> None:
    """out = std * (the truncated normal of each flat index): the definition, uniform() then the table, in bulk.

    `index` is int32 when every index is below 2**31, else int64 (then its high word joins the hash, as in uniform).
    """
    table = _tables(min(float(cutoff), _MAX_CUTOFF), out.device)
    k = key_words(key)
    # mix32's first step, x ^ (x >> 16), is linear: of index ^ key it is that of the index (once for both rows) ^ that
    # of the key. Row 0 computes uniform()'s a (key words 0 and 1), row 1 its b (words 2 and 3).
    inner_keys = [k[0] ^ (k[0] >> 16), k[2] ^ (k[2] >> 16)]
    words = [w - (1 << 32) if w >= 1 << 31 else w for w in inner_keys + [k[1], k[3]]]  # the same bits, as int32
    words = torch.tensor(words, dtype=torch.int32, device=out.device).view(4, 1)
    hi = None
    if index.dtype == torch.int64:
        hi, index = (index >> 32).to(torch.int32), index & _MASK32
    index = index ^ (index >> 16)  # index >= 0: >> is logical
    if hi is not None:
        index = (index - ((index >> 31) << 32)).to(torch.int32)
    x = torch.bitwise_xor(index, words[:2])
    tmp = torch.empty_like(x)
    _mix32_(x, tmp, xorshifted=True)
    x ^= words[2:]
    if hi is not None:
        x ^= hi
    _mix32_(x, tmp)
    torch.bitwise_right_shift(x, table["shift"], out=tmp)
    tmp &= table["mask"]
    # u * 2**53, an integer below 2**53: exact. Scaling u and the knots by a power of two changes no rounding.
    u = torch.add(tmp[1], tmp[0].to(torch.float64), alpha=2.0**27)
    j = _bin(x[0], u, table)
    # The interpolation in the bin, operation by operation as the definition rounds it: z0 + (u - p0) / dp * dz.
    u -= torch.index_select(table["p"], 0, j)
    u /= torch.index_select(table["dp"], 0, j)
    u *= table["dz"] if len(table["dz"]) == 1 else torch.index_select(table["dz"], 0, j)
    u += torch.index_select(table["z"], 0, j)
    torch.mul(u, std, out=out)  # in float64, rounded once to out's dtype


def _local_block(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The tensor this process holds, its shape, and its offset in the full parameter."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        local = param.to_local()
        assert tuple(local.shape) == tuple(shape), f"unexpected local shard {tuple(local.shape)} vs {shape}"
        return local, tuple(shape), tuple(offset)
    return param, tuple(param.shape), (0,) * param.dim()


@torch.no_grad()
def trunc_normal_(param: torch.Tensor, std: float, cutoff: float, key: str) -> None:
    """Fill `param` (a plain tensor or any DTensor shard) with N(0, std) truncated at +-cutoff std.

    `key` names the tensor (seed and parameter name): two tensors with the same key and shape get the same values.
    """
    local, _, offset = _local_block(param)
    fill_block_(local, tuple(param.shape), offset, std, cutoff, key)


@torch.no_grad()
def fill_block_(local: torch.Tensor, full_shape: tuple[int, ...], offset: tuple[int, ...], std: float,
                cutoff: float, key: str) -> None:
    """Fill `local`, the block at `offset` of a tensor of `full_shape`, with that tensor's values."""
    if local.numel() == 0:
        return
    if local.dim() == 0:
        local, full_shape, offset = local.view(1), (1,), (0,)
    shape, device = tuple(local.shape), local.device
    strides = [1] * len(full_shape)
    for d in range(len(full_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * full_shape[d + 1]
    dtype = torch.int32 if math.prod(full_shape) <= 1 << 31 else torch.int64
    # Global flat index of every local element except along dim 0, which is chunked below.
    inner = torch.zeros((), dtype=dtype, device=device)
    for d in range(1, len(shape)):
        inner = inner.unsqueeze(-1) + (torch.arange(shape[d], dtype=dtype, device=device) + offset[d]) * strides[d]
    inner = inner.reshape(1, -1)
    out = local if local.is_contiguous() else torch.empty(shape, dtype=local.dtype, device=device)
    chunk = _CHUNK * torch.get_num_threads() if device.type == "cpu" else _CHUNK_ACCELERATOR
    rows_per_chunk = max(1, chunk // inner.numel())
    for r0 in range(0, shape[0], rows_per_chunk):
        r1 = min(shape[0], r0 + rows_per_chunk)
        rows = (torch.arange(r0, r1, dtype=dtype, device=device) + offset[0]) * strides[0]
        _normal_at_(out[r0:r1].view(-1), (rows.view(-1, 1) + inner).view(-1), key, cutoff, std)
    if out is not local:
        local.copy_(out)
