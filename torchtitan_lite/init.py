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
"""

from __future__ import annotations

import functools
import hashlib
from statistics import NormalDist

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

_MASK32 = 0xFFFFFFFF
_TABLE_SIZE = 4096  # bins of the quantile table; each holds 1/4096 of [-cutoff, cutoff] in units of std
_MAX_CUTOFF = 8.0  # beyond 8 std the normal holds 1e-15 of its mass: "untruncated" for all purposes
_CHUNK = 1 << 22  # elements generated at once, bounding the int64 temporaries


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


def trunc_normal_from_uniform(u: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Map uniforms to a standard normal truncated to [-cutoff, cutoff] through the quantile table."""
    z_list, p_list = _quantile_table(min(float(cutoff), _MAX_CUTOFF))
    z = torch.tensor(z_list, dtype=torch.float64, device=u.device)
    p = torch.tensor(p_list, dtype=torch.float64, device=u.device)
    j = (torch.searchsorted(p, u, right=True) - 1).clamp_(0, _TABLE_SIZE - 1)
    p0, p1, z0 = p[j], p[j + 1], z[j]
    frac = (u - p0) / (p1 - p0).clamp_min(1e-300)
    return z0 + frac * (z[j + 1] - z0)


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


def fill_block_(local: torch.Tensor, full_shape: tuple[int, ...], offset: tuple[int, ...], std: float,
                cutoff: float, key: str) -> None:
    """Fill `local`, the block at `offset` of a tensor of `full_shape`, with that tensor's values."""
    if local.numel() == 0:
        return
    shape = tuple(local.shape)
    strides = [1] * len(full_shape)
    for d in range(len(full_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * full_shape[d + 1]
    # Global flat index of every local element except along dim 0, which is chunked below.
    inner = torch.zeros((), dtype=torch.int64, device=local.device)
    for d in range(1, len(shape)):
        ix = (torch.arange(shape[d], device=local.device) + offset[d]) * strides[d]
        inner = inner.unsqueeze(-1) + ix
    if len(shape) == 0:
        local.copy_(trunc_normal_from_uniform(uniform(inner.view(1), key), cutoff).view(()) * std)
        return
    rows_per_chunk = max(1, _CHUNK // max(1, inner.numel()))
    for r0 in range(0, shape[0], rows_per_chunk):
        r1 = min(shape[0], r0 + rows_per_chunk)
        rows = (torch.arange(r0, r1, device=local.device) + offset[0]) * strides[0]
        index = rows.view((-1,) + (1,) * inner.dim()) + inner
        local[r0:r1].copy_(trunc_normal_from_uniform(uniform(index, key), cutoff) * std)
