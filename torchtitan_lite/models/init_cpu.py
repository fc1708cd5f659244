"""The layout-invariant init's fill on the host: init_fill.c, one fused pass per element, where init.py's tensor ops
take ~36 passes over memory.

Host initialization (CPU runs, and every rank under CPU offload) fills whole shards on the CPU before step 1, so its
speed is the init's. The kernel is built once per machine with the system's C compiler ($CC, else `cc`), kept in
cache_dir(), and called through ctypes. Its values are init.py's definition bit for bit (tests/test_init.py compares
both paths with the plain definition); where no compiler works, kernel() is None, one warning says so, and init.py
fills with its tensor ops: the same values, several times slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from torchtitan_lite.config.paths import cache_dir, cpu_identity

logger = logging.getLogger("torchtitan_lite")

SOURCE = Path(__file__).with_name("init_fill.c")
# -march=native lets the hash vectorize; no value depends on it (init_fill.c says why), and the library's name
# carries the CPU's identity, so a cache shared by different machines never loads one built for other instructions.
# The build without it is the fallback for compilers that do not know the flag.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")
_PTR, _I64, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
# What the kernel may write through: a tensor subclass's pointer may be its wrapper's, not where its values live.
PLAIN = (torch.Tensor, torch.nn.Parameter)


class Tables(NamedTuple):
    """init.py's quantile table as the kernel reads it (see init_fill.c)."""
    first_bin: torch.Tensor  # int16, 2**16: the bin of t / 2**16
    bins: torch.Tensor  # float64, (bins, 4): p, dp, z, dz of each bin
    p_next: torch.Tensor  # float64: each bin's upper knot


def tables(z: list[float], p: list[float]) -> Tables:
    """From the knots (z, p), the quantities of the definition's interpolation, computed as it computes them."""
    z_, p_ = torch.tensor(z, dtype=torch.float64), torch.tensor(p, dtype=torch.float64)
    slots = torch.arange(1 << 16, dtype=torch.float64) * 2.0**-16
    first_bin = (torch.searchsorted(p_, slots, right=True) - 1).clamp_(0, len(z) - 2).to(torch.int16)
    dp, dz = (p_[1:] - p_[:-1]).clamp_min(1e-300), z_[1:] - z_[:-1]
    return Tables(first_bin, torch.stack([p_[:-1], dp, z_[:-1], dz], dim=1).contiguous(), p_[1:].contiguous())


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def _build() -> Path:
    """The kernel's library in cache_dir(), built there first if no process has built it yet."""
    compiler = _compiler()
    identity = repr((compiler, FLAGS, platform.machine(), cpu_identity())).encode()
    digest = hashlib.sha256(SOURCE.read_bytes() + identity).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"init_fill-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a name of its own and renamed into place: the ranks of a node may all build it at once.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for flags in (FLAGS, tuple(f for f in FLAGS if f != "-march=native")):
            try:
                result = subprocess.run([compiler, *flags, "-o", partial, str(SOURCE)], capture_output=True,
                                        text=True)
            except FileNotFoundError:
                raise OSError(f"{compiler}: not found") from None
            if result.returncode == 0:
                os.replace(partial, target)
                return target
        raise OSError(f"{compiler} failed: {(result.stderr.strip().splitlines() or ['no message'])[-1]}")
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The built kernel, or None (with one warning) where it cannot be built or loaded."""
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("init: the host's fused fill could not be built (%s); filling with tensor ops instead, the "
                       "same values, several times slower. Install a C compiler or set CC to one.", e)
        return None
    tables_args = [_PTR, _PTR, _PTR]  # first_bin, bins, p_next
    lib.fill.argtypes = [_I64, _I64, _PTR, _PTR, _F64, *tables_args, _PTR, _PTR]
    lib.quantiles.argtypes = [_PTR, _I64, _F64, *tables_args, _PTR, _PTR]
    lib.fill.restype = lib.quantiles.restype = None
    return lib


def _outputs(out: torch.Tensor) -> tuple[int | None, int | None]:
    assert type(out) in PLAIN, f"a plain tensor, not {type(out).__name__}"
    assert out.is_contiguous() and out.dtype in (torch.float32, torch.float64)
    return (out.data_ptr(), None) if out.dtype == torch.float64 else (None, out.data_ptr())


def fill_(out: torch.Tensor, row_start: torch.Tensor, key: list[int], std: float, t: Tables) -> None:
    """out (contiguous float32 or float64, viewed as len(row_start) rows) = std * the truncated normal of each
    element, whose global flat index is its row's start (int64) plus its place in the row."""
    assert row_start.dtype == torch.int64 and row_start.is_contiguous()
    rows = len(row_start)
    kernel().fill(rows, out.numel() // rows, row_start.data_ptr(), (ctypes.c_uint32 * 4)(*key), std,
                  t.first_bin.data_ptr(), t.bins.data_ptr(), t.p_next.data_ptr(), *_outputs(out))


def quantiles_(out: torch.Tensor, u: torch.Tensor, std: float, t: Tables) -> None:
    """out = std * the quantile of each u (float64, in [0, 1)): the kernel's second half alone, for tests."""
    assert u.dtype == torch.float64 and u.is_contiguous() and out.numel() == u.numel()
    kernel().quantiles(u.data_ptr(), u.numel(), std, t.first_bin.data_ptr(), t.bins.data_ptr(), t.p_next.data_ptr(),
                       *_outputs(out))
