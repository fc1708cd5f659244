"""Process environment: ranks, device, process group, threads, determinism."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Env:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> Env:
        """What torchrun set (or a single process when run as plain `python train.py`)."""
        get = lambda name, default: int(os.environ.get(name, default))  # noqa: E731
        return cls(get("RANK", 0), get("LOCAL_RANK", 0), get("WORLD_SIZE", 1), get("LOCAL_WORLD_SIZE", 1))


def init_distributed(env: Env, timeout_s: int = 600) -> torch.device:
    """CUDA + NCCL when there are GPUs, else CPU + gloo with the cores shared among the local processes."""
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // env.local_world_size))
        backend = "gloo"
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        # Plain `python train.py`: a one-process group, so the mesh code path is the same. Its store lives in this
        # process, so two such runs on one machine can never race for a port.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout_s))
    else:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return device


_timeout = "comm.init_timeout_seconds"  # the option whose bound is in force


def set_timeout(seconds: int) -> None:
    """Every process group's collective timeout, for training (the mesh's subgroups took the start-up one)."""
    global _timeout
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    _timeout = f"comm.train_timeout_seconds = {seconds}"


def peer_timeout(error: RuntimeError) -> RuntimeError | None:
    """gloo's "Timed out waiting" as a message naming the cause and the bound, or None for any other error. (NCCL's
    watchdog ends the process itself after the same timeout, with its own message.)"""
    message = str(error)
    if "Timed out" not in message:
        return None
    return RuntimeError(f"a collective waited longer than {_timeout} s: a peer rank is hung, stopped or dead "
                        f"(gloo: {message[message.index('Timed out'):].splitlines()[0]})")


def set_determinism(seed: int, deterministic: bool, device: torch.device) -> None:
    torch.manual_seed(seed)
    if deterministic:
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
