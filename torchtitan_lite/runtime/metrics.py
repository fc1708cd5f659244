"""Throughput accounting: FLOPs per token, the peak FLOP/s MFU is measured against, memory. The logger that writes
the numbers is metric_logger.py."""

import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchtitan_lite.config.paths import cache_dir, cpu_identity

logger = logging.getLogger("torchtitan_lite")


def flops_per_token(
    num_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int, embedding_params: int
) -> float:
    """Training FLOPs per token: 6·N + 12·L·H·D·S (PaLM appendix B, as torchtitan counts it).

    6·N: every non-embedding weight does one multiply-add (2 FLOPs) per token in the forward pass and two in the
    backward pass (grad of input and grad of weight). N excludes the token-embedding table because it is a lookup,
    not a matmul; an untied output projection is a matmul and stays in N.
    12·L·H·D·S: the attention scores (QKᵀ) and the weighted sum of values, 2 matmuls × 2 FLOPs × 3 (fwd + bwd), each
    of size H·D·S per token per layer. Like PaLM we count the full S×S square, ignoring the causal mask's savings.
    """
    n = num_params - embedding_params
    return 6.0 * n + 12.0 * n_layers * n_heads * head_dim * seq_len


# Dense (no sparsity) peaks in FLOP/s, from NVIDIA's datasheets (which quote fp8 and bf16 with 2:4 sparsity: twice
# these): (name substring, bf16/fp16 tensor core, fp8 tensor core or None without fp8 units, plain fp32).
# Order matters: the first substring found in the device name wins, so the NVL and PCIe variants precede plain
# "H100"/"H200" (the SXM part reports itself as e.g. "NVIDIA H100 80GB HBM3").
_GPU_PEAKS = [
    ("H100 NVL", 835e12, 1670e12, 60e12),
    ("H100 PCIe", 756e12, 1513e12, 51e12),
    ("H100", 989e12, 1979e12, 67e12),
    ("H200 NVL", 835e12, 1670e12, 60e12),
    ("H200", 989e12, 1979e12, 67e12),
    ("A100", 312e12, None, 19.5e12),
    ("L40S", 362e12, 733e12, 91.6e12),
    ("B200", 2250e12, 4500e12, 75e12),
]
FLOAT8 = torch.float8_e4m3fn  # peak_flops' dtype for float8 matmuls (torchao's Float8Linear, not emulated)


@functools.cache
def _gpu_peak(name: str, dtype: torch.dtype, tf32: bool) -> float:
    entry = next((e for e in _GPU_PEAKS if e[0] in name), None)
    if entry is None:  # lru_cache makes this warn once per device name
        logger.warning("unknown GPU %r: MFU uses the H100 SXM peak", name)
        entry = _GPU_PEAKS[2]
    _, half, fp8, fp32 = entry
    if dtype == FLOAT8 and fp8 is not None:  # no fp8 units (A100): float8 cannot run unemulated there anyway
        return fp8
    if dtype in (torch.bfloat16, torch.float16, FLOAT8):
        return half
    # fp32 matmuls run on TF32 tensor cores only when the user allowed it; torch's default keeps them on the plain
    # fp32 units, whose peak is ~15x lower. The TF32 dense peak is half the bf16 one on all the parts above.
    return half / 2 if tf32 else fp32


def _tf32_allowed() -> bool:
    # Read the new per-backend setting: get_float32_matmul_precision() raises once the new API has been used.
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        return matmul.fp32_precision == "tf32"
    return matmul.allow_tf32


# How the CPU's peak is measured; part of its cache key, so a change of method measures anew.
_CPU_METHOD = "512^3 matmuls in 3 layouts, best time of >= 5 calls and >= 0.5 s each"
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def _measure_cpu_peak(dtype: torch.dtype, num_threads: int) -> float:
    """FLOP/s of the fastest matmul layout in `dtype` on `num_threads` threads (see cpu_peak for why the fastest)."""
    before = torch.get_num_threads()  # a check measures for the workers, which get fewer threads than it has
    torch.set_num_threads(num_threads)
    try:
        return _time_matmuls(dtype)
    finally:
        torch.set_num_threads(before)


def _time_matmuls(dtype: torch.dtype) -> float:
    n = 512
    g = torch.Generator().manual_seed(0)  # not the global generator: a run's RNG state never depends on the cache
    a, b = torch.randn(n, n, dtype=dtype, generator=g), torch.randn(n, n, dtype=dtype, generator=g)
    best = float("inf")
    for x, y in ((a, b), (a, b.t()), (a.t(), b)):
        x @ y  # warm up: the first call pays for allocation and kernel selection
        # The best of many calls over half a second: a peak, not an average, taken past the moments another process
        # has the core (the best of three calls moved with the machine's load several times as much: performance.md).
        calls, start = 0, time.perf_counter()
        while calls < 5 or time.perf_counter() - start < 0.5:
            t0 = time.perf_counter()
            x @ y
            best = min(best, time.perf_counter() - t0)
            calls += 1
    return 2.0 * n**3 / best


@functools.cache
def cpu_peak(dtype: torch.dtype, num_threads: int) -> tuple[float, str]:
    """(FLOP/s, what it is) of this CPU's matmuls in `dtype` on `num_threads` threads, measured once per machine.

    A CPU has no datasheet peak we can trust (turbo, AVX-512/AMX, shared cores), so "peak" is what matmuls in the
    training dtype achieve here with this thread count; MFU is the model's share of that rate. A step multiplies in
    three layouts (forward x @ W^T, backward g @ W and g^T @ x), and a CPU may run them at rates an order of
    magnitude apart (fp16 on CPUs without fp16 units; docs/performance.md), so the peak is the fastest layout's: a
    model made of them cannot beat it, and MFU stays at most 100%. Keyed on the thread count because torchrun ranks on
    one host may each be given fewer threads.

    A peak each process measures at its start moves with whatever else runs (ranks measuring at once on shared
    cores time each other's load), and MFU with it, for the same model at the same speed. So it is measured once per
    machine, by one process under a file lock while the others wait, and kept in cache_dir() under a key of the
    dtype, thread count, CPU (model and instruction sets), torch version (its matmul kernels) and the method: every
    later run on this machine divides by the same number. Deleting the file measures again.
    """
    what = f"{_SHORT.get(dtype, str(dtype))} matmul peak of this CPU, {num_threads} thread{'s' * (num_threads > 1)}"
    key = repr((str(dtype), num_threads, platform.machine(), cpu_identity(), torch.__version__, _CPU_METHOD))
    path = cache_dir() / "cpu_peak" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
            record = _read_peak(path, key)
            if record is None:
                record = {"flops": _measure_cpu_peak(dtype, num_threads), "measured": time.strftime("%Y-%m-%d %H:%M"),
                          "key": key}
                _write_atomically(path, json.dumps(record))
    except OSError as e:  # no cache folder to write: measured by each process, as before
        logger.warning("cannot keep the CPU's peak in %s (%s): measured now, and MFU may differ between runs",
                       path, e)
        flops = _measure_cpu_peak(dtype, num_threads)
        return flops, f"{what}: {flops / 1e9:.1f} GFLOP/s, measured at start (not cached: {e})"
    flops = record["flops"]
    return flops, f"{what}: {flops / 1e9:.1f} GFLOP/s, measured once ({record['measured']}), cached in {path}"


def _read_peak(path: Path, key: str) -> dict | None:
    """The cached record of `key`, or None when there is none or it is unreadable."""
    try:
        record = json.loads(path.read_text())
        valid = record.get("key") == key and isinstance(record.get("flops"), float) and record["flops"] > 0
        return record if valid else None
    except (OSError, ValueError, AttributeError):
        return None


def _write_atomically(path: Path, text: str) -> None:
    """Written under a name of its own and renamed into place: a reader sees the whole file or none."""
    fd, partial = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Peak FLOP/s of one device for matmuls in `dtype`: a datasheet table on GPU, a measurement kept per machine on
    CPU. `FLOAT8`: the fp8 tensor cores' peak, which a float8 run's MFU is against (docs/float8.md says why)."""
    return stated_peak_flops(device, dtype)[0]


def stated_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """peak_flops and a line saying what it is, for the start-up summary: which figure MFU is a share of."""
    if device.type == "cuda":
        name, tf32 = torch.cuda.get_device_name(device), _tf32_allowed()
        flops = _gpu_peak(name, dtype, tf32)
        entry = next((e for e in _GPU_PEAKS if e[0] in name), None)
        if dtype == FLOAT8:  # a part without fp8 units is at its bf16 peak (_gpu_peak)
            kind = "fp8" if entry is None or entry[2] is not None else "bf16"
        else:
            kind = "tf32" if dtype == torch.float32 and tf32 else _SHORT.get(dtype, str(dtype))
        source = "datasheet" if entry else "unknown GPU: the H100 SXM's datasheet"
        return flops, f"{kind} dense peak of {name} ({source}): {flops / 1e12:.1f} TFLOP/s"
    return cpu_peak(dtype, torch.get_num_threads())


def memory_gib(device: torch.device) -> float:
    """Peak allocated memory on CUDA; on CPU the process's current resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/statm") as f:  # fields are in pages; the second is resident
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):  # no /proc (macOS): the max RSS, in bytes there, KiB on Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 2**30 if sys.platform == "darwin" else rss * 1024 / 2**30


def allocator_fields(device: torch.device) -> dict[str, float]:
    """GPU: the caching allocator's peak reserved memory, its retries (a full cache flushed to satisfy an allocation:
    a step near its memory limit) and its out-of-memory errors, as torchtitan logs them; nothing on the CPU. Read
    from the host's counters: no device sync."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"max_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
            "alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0)}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors count their local shard; None is skipped).

    Storages, not tensor sizes: FSDP2 pads each parameter's shard to an even split and keeps the padded buffer, and
    its sharded gradients of one block are views into one reduce-scatter output, so a storage shared by several
    tensors counts once. Told apart by StorageImpl (`_cdata`), not `data_ptr()`, which is 0 for every meta and fake
    tensor (memory.py's estimate counts fake ones) and would merge them all."""
    seen = {}
    for t in tensors:
        for inner in () if t is None else _inner_tensors(t):
            storage = inner.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding `t`'s data. A wrapper subclass has an empty storage of its own and its data in
    tensor attributes: a DTensor its local shard, torchao's weight for FSDP's float8 all-gather (quantization/float8.py)
    the high-precision weight and its precomputed scale. Read from the attributes, not `__tensor_flatten__`, which that
    weight answers by testing its scale's value: a device read on a GPU, an error on the estimate's fake tensors."""
    if isinstance(t, DTensor):
        return _inner_tensors(t._local_tensor)  # to_local() makes a view, without the float8 weight's scale
    if not is_traceable_wrapper_subclass(t):
        return [t]
    return [plain for x in vars(t).values() if isinstance(x, torch.Tensor) for plain in _inner_tensors(x)]


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state; call after backward, before zero_grad."""
    params = list(model.parameters())
    return {
        "param_bytes": storage_bytes(params),
        "grad_bytes": storage_bytes(p.grad for p in params),
        "optimizer_bytes": storage_bytes(v for state in optimizer.state.values() for v in state.values()
                                         if isinstance(v, torch.Tensor)),
    }
