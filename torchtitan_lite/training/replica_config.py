"""What a run of replica groups (training/replicas.py) accepts, checked before any process starts, and torchft,
imported once and quiet."""

from __future__ import annotations

import logging
import os
import warnings

from torchtitan_lite.config import ConfigError, JobConfig
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.quantization import float8


def check_replicas(cfg: JobConfig, dims: ParallelDims, global_batch: int, moe: bool) -> int:
    """The run's global batch with replica groups, or a ConfigError for what they cannot do yet. Exact mode: rows of
    a micro-batch on each data-parallel rank of a group (dims.global_batch checks that), which the live groups share
    unevenly (loader.group_share), at least one for each group: one with none would have no gradients to sum. Fast
    mode: as many rows for each group (its own fixed share). -1 is a row for each group."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return global_batch
    if ft.replica_id >= ft.group_size:
        raise ConfigError(f"fault_tolerance.replica_id {ft.replica_id} must be below fault_tolerance.group_size "
                          f"{ft.group_size}: number the groups 0 to {ft.group_size - 1}")
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(f"fault_tolerance.min_replica_size {ft.min_replica_size} is more than the "
                          f"{ft.group_size} groups (fault_tolerance.group_size): no step could ever commit")
    if not (ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise ConfigError("fault_tolerance.enable needs the torchft lighthouse's address: set "
                          "fault_tolerance.lighthouse http://HOST:PORT or TORCHFT_LIGHTHOUSE")
    try:
        import_torchft()
    except ImportError:
        raise ConfigError("fault_tolerance.enable needs torchft: pip install torchft==0.2.0") from None
    unsupported = {"parallelism.data_parallel_replicate_degree": dims.dp_replicate > 1,
                   "checkpoint.create_seed_checkpoint": cfg.checkpoint.create_seed_checkpoint,
                   "compile.enable": cfg.compile.enable,
                   "float8.enable_float8_linear": float8.enabled(cfg), "a mixture-of-experts flavor": moe,
                   f"training.dataset {cfg.training.dataset}": cfg.training.dataset in ("mixture", "hf"),
                   "validation.enable": cfg.validation.enable,
                   # Each group would write its own files under the same names, or a curve of its own.
                   "metrics.enable_tensorboard": cfg.metrics.enable_tensorboard,
                   "metrics.enable_wandb": cfg.metrics.enable_wandb,
                   "profiling.enable_profiling": cfg.profiling.enable_profiling,
                   "profiling.enable_memory_snapshot": cfg.profiling.enable_memory_snapshot}
    if refused := [k for k, on in unsupported.items() if on]:
        raise ConfigError(f"replica groups (fault_tolerance.enable) train FSDP, TP, PP and CP layouts of a dense "
                          f"model on random-access data, without validation or traces so far: turn off "
                          f"{', '.join(refused)}")
    row, groups = cfg.training.local_batch_size * dims.dp, ft.group_size
    batch = row * groups if cfg.training.global_batch_size == -1 else global_batch
    groups_of = (f"{groups} groups of local_batch_size {cfg.training.local_batch_size} x data-parallel degree "
                 f"{dims.dp}")
    if ft.mode == "fast" and batch % (row * groups):
        raise ConfigError(f"training.global_batch_size {batch} does not split into whole micro-batches over "
                          f"{groups_of}: use a multiple of {row * groups}")
    if batch < row * groups:
        raise ConfigError(f"training.global_batch_size {batch} gives fewer than one micro-batch to each of "
                          f"{groups_of}: use at least {row * groups}")
    return batch


def import_torchft():
    """torchft (optional, as torchao is), quiet: its own logs say a few lines per step and rank (its Rust part reads
    RUST_LOG once, at import, and logs at INFO without it) and a failed collective's traceback, where this file says
    what happened in one line."""
    os.environ.setdefault("RUST_LOG", "error")
    import torchft  # noqa: PLC0415

    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)  # its receive of a state
    warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)
    return torchft
