"""Layout-invariant random initialization.

A parameter's initial value must not depend on how it is sharded: 1 process, FSDP 8 and TP 2 x FSDP 4 must start
from the same full tensors, or their loss curves part at step 1. torch's generators cannot promise that (DTensor's
random ops are not layout-consistent on the CPU, and a sharded parameter never exists whole), so every element is
computed from (seed, parameter name, global element index) alone, by a counter-based generator evaluated only on the
local shard: O(shard) memory and time, no communication.

Bitwise equality also needs every operation to round the same way wherever an element lands in a kernel's
vectorized body or scalar tail. So the generator uses only integer ops, comparisons, IEEE-exact float64 + - * / and
conversions (rounded to nearest even, exactly as IEEE 754 specifies); the normal quantile comes from a table computed
once in Python scalars, not from erfinv or log (whose vectorized and scalar code paths differ in the last bit on the
CPU).

Host initialization (CPU runs, and every rank under CPU offload) makes its speed matter. On the host a shard is
filled by one fused C loop (init_fill.c, built and called by init_cpu.py), about as fast as torch's `normal_`. On
accelerators, and on a host without a C compiler, it is filled in bulk by tensor ops, about 36 whole-tensor ops per
chunk: the hash runs on int32 lanes, both of uniform()'s streams in one tensor, and a draw's bin comes from a lookup
(2**16 buckets, the float16 bits of u's top 26 bits as a signed integer: finer towards both ends of [0, 1), as the
bins are) and one comparison. Each op writes into buffers made once, in place where it can. Both paths give the
plain definition's values, uniform() then a search of the table, bit for bit: tests/test_init.py keeps that
definition to compare against, and benchmarks/init_speed.py times them against torch's `normal_`.
"""

from __future__ import annotations

import functools
import hashlib
import math
from statistics import NormalDist

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan_lite.models import init_cpu

_MASK32 = 0xFFFFFFFF
_TABLE_SIZE = 4096  # bins of the quantile table; each holds 1/4096 of [-cutoff, cutoff] in units of std
_MAX_CUTOFF = 8.0  # beyond 8 std the normal holds 1e-15 of its mass: "untruncated" for all purposes
_CHUNK = 1 << 15  # elements generated at once per CPU thread: the chunk's buffers stay in cache
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


def _bucket_(high: torch.Tensor, f32: torch.Tensor, f16: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> None:
    """out = the lookup bucket of each draw, from `high`, u's top 26 bits as a signed int32 (negative where u >= 1/2):
    the bits of its float16 value, sign, 5 exponent and 10 mantissa bits. The 2**16 buckets narrow towards both ends
    of [0, 1) as the bins of the quantile table do, so that nearly all hold at most one knot. Each conversion rounds
    to nearest, ties to even, as IEEE 754 specifies for every device; `f32` and `f16` are scratch."""
    f32.copy_(high)
    f32.mul_(scale)  # 2**-10: exact, and brings +-2**25 within float16's range
    f16.copy_(f32)
    out.copy_(f16.view(torch.uint16))


@functools.lru_cache(maxsize=1)
def _bucket_ranges() -> tuple[torch.Tensor, torch.Tensor]:
    """[lower, upper) of the u in each of _bucket_'s buckets (empty where lower == upper): what _bucket_ does, undone
    by a bisection over its own ops, so that no rounding rule has to be restated here."""
    def bucket_of_magnitude(m):  # the bucket of -m without its sign bit: that of m, as rounding is symmetric
        out = torch.empty(len(m), dtype=torch.int32)
        f32, f16 = torch.empty(len(m), dtype=torch.float32), torch.empty(len(m), dtype=torch.float16)
        _bucket_((-m).to(torch.int32), f32, f16, out, torch.tensor(2.0**-10, dtype=torch.float32))
        return out & 0x7FFF

    # first[b]: the least m in [0, 2**25] whose bucket is b or above (2**25 + 1 where none is); first[0] is 0. (2**15
    # bisections at once: below torch's grain size, so one thread runs them, without waiting on busy cores.)
    b = torch.arange(1, (1 << 15) + 1)
    first, last = torch.zeros_like(b), torch.full_like(b, (1 << 25) + 1)
    for _ in range(26):
        mid = (first + last) // 2
        above = bucket_of_magnitude(mid.clamp_max(1 << 25)) >= b
        first, last = torch.where(above, first, torch.maximum(first, mid + 1)), torch.where(above, mid, last)
    first = torch.cat([first.new_zeros(1), first])
    lo, hi = first[:-1], first[1:]  # bucket b holds the m in [lo, hi)
    # high >= 0 (u < 1/2) is m itself; high < 0 is -m for 1 <= m <= 2**25, where u's top 26 bits are 2**26 - m
    near = lo.clamp_max(1 << 25), hi.clamp_max(1 << 25)
    far = (1 << 26) + 1 - hi.clamp_max((1 << 25) + 1), (1 << 26) + 1 - lo.clamp_min(1)
    lower = torch.cat([near[0], far[0]]).to(torch.float64) * 2.0**-26
    upper = torch.cat([near[1], far[1]]).to(torch.float64) * 2.0**-26
    return lower, torch.maximum(lower, upper)


@functools.lru_cache(maxsize=16)
def _tables(cutoff: float, device: torch.device) -> dict[str, torch.Tensor]:
    """The quantile table as _Fill reads it: one column per bin quantity, and the lookup of a draw's bin."""
    z_list, p_list = _quantile_table(cutoff)
    z = torch.tensor(z_list, dtype=torch.float64)
    p = torch.tensor(p_list, dtype=torch.float64)
    # The knots' p are kept times 2**53, as the draws' u are (exact: a power of two).
    # With p[0] == 0 <= u < 1 == p[-1] and p sorted, the bin of u, clamp(searchsorted(p, u, right=True) - 1, 0, 4095),
    # is the number of p[1:] <= u: a count, which a lookup and one comparison can make.
    assert p[0] == 0 and p[-1] == 1 and bool((p[1:] >= p[:-1]).all())
    # When the bins of a bucket's first and last u differ by at most one, the bucket holds at most one knot: a u inside
    # is in the lower bin, or in the next one when u >= that bin's upper knot. Buckets holding more knots (at the very
    # ends, where the bins are finer than the buckets: about one draw in a million) are flagged by + _TABLE_SIZE, which
    # finds an infinite upper knot, and their draws are searched.
    lower, upper = _bucket_ranges()
    first, last = (torch.searchsorted(p, u, right=True).sub_(1).clamp_(0, _TABLE_SIZE - 1)
                   for u in (lower, upper - 2.0**-53))  # upper - 2**-53: the bucket's last u (both exact)
    one_knot = (upper > lower) & (last - first <= 1)
    dz = z[1:] - z[:-1]
    even = bool((dz == dz[0]).all())  # exactly even knots (cutoffs 8 and 3): one dz
    # Knots a power of two apart (cutoff 8): (u - p0) / dp * dz == (u - p0) / (dp / dz) exactly, a multiply fewer.
    fold = even and math.frexp(dz[0].item())[0] == 0.5
    columns = {
        "bin": torch.where(one_knot, first, first + _TABLE_SIZE).to(torch.int32),
        "p_upper": torch.cat([p[1:], torch.full((_TABLE_SIZE,), math.inf, dtype=torch.float64)]) * 2.0**53,
        "p": p[:-1] * 2.0**53,
        "dp": (p[1:] - p[:-1]).clamp_min(1e-300) * 2.0**53 / (dz[0] if fold else 1.0),
        "z": z[:-1],
        "dz": dz[:0] if fold else dz[:1] if even else dz,
    }
    return {name: c.contiguous().to(device) for name, c in columns.items()}


def _bin_(j: torch.Tensor, bucket: torch.Tensor, u: torch.Tensor, table: dict[str, torch.Tensor],
          knot: torch.Tensor, past: torch.Tensor) -> None:
    """j = the bin of each draw (its bucket, and its u times 2**53), as searchsorted finds it: its bucket's lower bin,
    plus one when u is at or past that bin's upper knot. `knot` (float64) and `past` (int32) are scratch."""
    torch.index_select(table["bin"], 0, bucket, out=j)
    torch.index_select(table["p_upper"], 0, j, out=knot)
    torch.ge(u, knot, out=past)
    j += past
    if j.amax().item() >= _TABLE_SIZE:
        far = (j >= _TABLE_SIZE).nonzero().squeeze(1)
        j[far] = torch.searchsorted(table["p_upper"][:_TABLE_SIZE], u[far], right=True, out_int32=True)


class _Buffers:
    """Buffers for chunks of up to n elements: every op of a chunk writes into them, in place where it can (an op that
    writes a fresh tensor costs about twice one that updates its input), so that a chunk's working set stays the same
    few buffers. Views of them are made once per chunk size: each costs as much as a small op."""

    def __init__(self, n: int, device: torch.device):
        self.n = n
        self.i32 = torch.empty(4 * n, dtype=torch.int32, device=device)
        self.f64 = torch.empty(3 * n, dtype=torch.float64, device=device)
        self.f32 = torch.empty(n, dtype=torch.float32, device=device)
        self.f16 = torch.empty(n, dtype=torch.float16, device=device)
        self.chunks = {}

    def views(self, m: int) -> tuple[torch.Tensor, ...]:
        """x and tmp (int32, 2 x m), u, col and col2 (float64), f32 and f16, for a chunk of m <= n elements."""
        if m not in self.chunks:
            i32, f64 = self.i32[: 4 * m].view(4, m), self.f64[: 3 * m].view(3, m)
            self.chunks[m] = (i32[:2], i32[2:], *f64, self.f32[:m], self.f16[:m])
        return self.chunks[m]


# Kept between fills (the largest so far, a few MiB per thread): fresh megabytes would cost each fill their page
# faults. One process fills one tensor at a time.
_cpu_buffers: list[_Buffers] = []


def _buffers(n: int, device: torch.device) -> _Buffers:
    if device.type != "cpu":  # where a caching allocator keeps freed memory, and chunks are large
        return _Buffers(n, device)
    if not _cpu_buffers or _cpu_buffers[0].n < n:
        _cpu_buffers[:] = [_Buffers(n, device)]
    return _cpu_buffers[0]


@functools.lru_cache(maxsize=8)
def _constants(device: torch.device) -> dict[str, torch.Tensor]:
    """The hash's constants as tensors: a Python int operand costs an op a conversion, as much as a small op."""
    ints = {"m1": 0x21F0AAAD, "m2": 0x735A2D97, "15": 15, "16": 16, "low15": (1 << 17) - 1, "low16": (1 << 16) - 1}
    c = {name: torch.tensor(v, dtype=torch.int32, device=device) for name, v in ints.items()}
    c["scale"] = torch.tensor(2.0**-10, dtype=torch.float32, device=device)
    # uniform()'s a >> 6 and b >> 5, as logical shifts of the int32 rows holding a and b
    c["shift"] = torch.tensor([[6], [5]], dtype=torch.int32, device=device)
    c["mask"] = torch.tensor([[(1 << 26) - 1], [(1 << 27) - 1]], dtype=torch.int32, device=device)
    return c


class _Fill:
    """Fills one block, chunk by chunk, with the definition's values: uniform() then the table, in bulk. What the
    chunks share is made once: the key's words, the tables, the constants and the buffers."""

    def __init__(self, key: str, cutoff: float, n: int, device: torch.device):
        self.table, self.c = _tables(cutoff, device), _constants(device)
        self.buffers = _buffers(n, device)
        k = key_words(key)
        # mix32's first step, x ^ (x >> 16), is linear: of index ^ key it is that of the index (once for both rows) ^
        # that of the key. Row 0 computes uniform()'s a (key words 0 and 1), row 1 its b (words 2 and 3).
        words = [k[0] ^ (k[0] >> 16), k[2] ^ (k[2] >> 16), k[1], k[3]]
        words = [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # the same bits, as int32
        self.words = torch.tensor(words, dtype=torch.int32, device=device).view(4, 1)

    def _xorshift_(self, x: torch.Tensor, tmp: torch.Tensor, shift: str) -> None:
        torch.bitwise_right_shift(x, self.c[shift], out=tmp)
        tmp &= self.c["low" + shift]  # >> is arithmetic on int32: the mask makes it logical
        x ^= tmp

    def _mix32_(self, x: torch.Tensor, tmp: torch.Tensor, xorshifted: bool = False) -> None:
        """mix32 in place on int32 lanes, where a multiply wraps as the uint32 one does. `xorshifted`: x has had
        mix32's first step, x ^= x >> 16, already."""
        if not xorshifted:
            self._xorshift_(x, tmp, "16")
        x *= self.c["m1"]  # both multipliers are < 2**31: int32 values
        self._xorshift_(x, tmp, "15")
        x *= self.c["m2"]
        self._xorshift_(x, tmp, "15")

    def __call__(self, out: torch.Tensor, index: torch.Tensor, std: float) -> None:
        """out = std * (the truncated normal of each flat index). `index` is int32 when every index is below 2**31
        (and is overwritten), else int64 (then its high word joins the hash, as in uniform)."""
        c, table = self.c, self.table
        x, tmp, u, col, col2, f32, f16 = self.buffers.views(out.numel())
        hi = None
        if index.dtype == torch.int64:
            hi, index = (index >> 32).to(torch.int32), index & _MASK32
            index = index ^ (index >> 16)  # index >= 0: >> is logical
            index = (index - ((index >> 31) << 32)).to(torch.int32)
        else:
            torch.bitwise_right_shift(index, c["16"], out=tmp[0])  # index >= 0: >> is logical
            index ^= tmp[0]
        torch.bitwise_xor(index, self.words[:2], out=x)
        self._mix32_(x, tmp, xorshifted=True)
        x ^= self.words[2:]
        if hi is not None:
            x ^= hi
        self._mix32_(x, tmp)
        torch.bitwise_right_shift(x, c["shift"], out=tmp)
        bucket, j = x  # the hash is done: its rows now hold the draws' buckets, then their bins
        _bucket_(tmp[0], f32, f16, bucket, c["scale"])  # from a >> 6, arithmetic: u's top 26 bits
        tmp &= c["mask"]
        # u * 2**53, an integer below 2**53: exact. Scaling u and the knots by a power of two changes no rounding.
        u.copy_(tmp[1])
        u.add_(tmp[0], alpha=2.0**27)
        _bin_(j, bucket, u, table, col, tmp[0])
        # The interpolation in the bin, operation by operation as the definition rounds it: z0 + (u - p0) / dp * dz.
        u -= torch.index_select(table["p"], 0, j, out=col)
        torch.index_select(table["dp"], 0, j, out=col)
        torch.index_select(table["z"], 0, j, out=col2)
        if len(table["dz"]) == 0:  # dz folded into dp
            torch.addcdiv(col2, u, col, out=u)
        else:
            u /= col
            u *= table["dz"] if len(table["dz"]) == 1 else torch.index_select(table["dz"], 0, j)
            u += col2
        u *= std
        out.copy_(u)  # rounded once to out's dtype


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


def canonical_name(name: str) -> str:
    """A parameter's name without wrapper prefixes (activation checkpointing, compile): the name a `key` is made of,
    so a wrapped model draws the same values."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


@torch.no_grad()
def fill_block_(local: torch.Tensor, full_shape: tuple[int, ...], offset: tuple[int, ...], std: float,
                cutoff: float, key: str) -> None:
    """Fill `local`, the block at `offset` of a tensor of `full_shape`, with that tensor's values."""
    if local.numel() == 0:
        return
    if local.dim() == 0:
        local, full_shape, offset = local.view(1), (1,), (0,)
    cutoff = min(float(cutoff), _MAX_CUTOFF)
    # The kernel writes through the tensor's pointer: a plain tensor's memory. Tensor subclasses (torchao's float8
    # weights, the memory estimator's fake tensors) take the tensor ops, which dispatch through them.
    on_host = local.device.type == "cpu" and type(local) in init_cpu.PLAIN and init_cpu.kernel() is not None
    dtype = local.dtype if not on_host or local.dtype in (torch.float32, torch.float64) else torch.float64
    out = local if local.is_contiguous() and local.dtype == dtype else torch.empty(local.shape, dtype=dtype,
                                                                                      device=local.device)
    (_fill_on_host if on_host else _fill_in_bulk)(out, tuple(full_shape), tuple(offset), std, cutoff, key)
    if out is not local:
        local.copy_(out)  # rounded once more, from float64 where the kernel wrote that, as the definition rounds


def _strides(full_shape: tuple[int, ...]) -> list[int]:
    return [math.prod(full_shape[d + 1:]) for d in range(len(full_shape))]


@functools.lru_cache(maxsize=16)
def _host_tables(cutoff: float) -> init_cpu.Tables:
    return init_cpu.tables(*_quantile_table(cutoff))


def _fill_on_host(out: torch.Tensor, full_shape: tuple[int, ...], offset: tuple[int, ...], std: float,
                  cutoff: float, key: str) -> None:
    """The fused kernel, row by row of the last dimension (whose elements have consecutive global indices)."""
    strides = _strides(full_shape)
    row_start = torch.tensor(offset[-1], dtype=torch.int64)
    for d in range(out.dim() - 1):
        row_start = row_start.unsqueeze(-1) + (torch.arange(out.shape[d]) + offset[d]) * strides[d]
    init_cpu.fill_(out, row_start.reshape(-1), key_words(key), std, _host_tables(cutoff))


def _fill_in_bulk(out: torch.Tensor, full_shape: tuple[int, ...], offset: tuple[int, ...], std: float,
                  cutoff: float, key: str) -> None:
    """Tensor ops, chunk by chunk of rows along dim 0: on accelerators, and on hosts without the kernel."""
    shape, device = tuple(out.shape), out.device
    strides = _strides(full_shape)
    dtype = torch.int32 if math.prod(full_shape) <= 1 << 31 else torch.int64
    # Global flat index of every local element except along dim 0, which is chunked below.
    inner = torch.zeros((), dtype=dtype, device=device)
    for d in range(1, len(shape)):
        inner = inner.unsqueeze(-1) + (torch.arange(shape[d], dtype=dtype, device=device) + offset[d]) * strides[d]
    inner = inner.reshape(1, -1)
    chunk = _CHUNK * torch.get_num_threads() if device.type == "cpu" else _CHUNK_ACCELERATOR
    chunks = -(-shape[0] * inner.numel() // chunk)
    rows_per_chunk = -(-shape[0] // chunks)  # even chunks: no last one of a few rows, that would cost as much
    # The first chunk's index; a later one's is that plus its rows' offset.
    first = (torch.arange(rows_per_chunk, dtype=dtype, device=device) + offset[0]) * strides[0]
    first = (first.view(-1, 1) + inner).view(-1)
    fill, index = _Fill(key, cutoff, first.numel(), device), torch.empty_like(first)
    for r0 in range(0, shape[0], rows_per_chunk):
        m = (min(shape[0], r0 + rows_per_chunk) - r0) * inner.numel()
        torch.add(first[:m], r0 * strides[0], out=index[:m])
        fill(out[r0 : r0 + rows_per_chunk].view(-1), index[:m], std)
