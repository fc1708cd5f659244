"""Process environment: ranks, device, process group, threads, determinism."""

from __future__ import annotations

import contextlib
import functools
import os
import time
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


def cpu_threads(local_processes: int) -> int:
    """Threads each of `local_processes` CPU processes computes with: this machine's cores shared among them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // local_processes)


def init_distributed(env: Env, timeout_s: int = 600, jobs_here: int = 1) -> torch.device:
    """CUDA + NCCL when there are GPUs, else CPU + gloo with the cores shared among the local processes: those of
    `jobs_here` alike jobs on this machine (replica groups that share it)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads(env.local_world_size * jobs_here))
        backend = "gloo"
    global _timeout
    timeout, _timeout = timedelta(seconds=timeout_s), f"comm.init_timeout_seconds = {timeout_s}"
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        # Plain `python train.py`: a one-process group, so the mesh code path is the same. Its store lives in this
        # process, so two such runs on one machine can never race for a port.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif (agent := agent_store()) is not None:
        store = _round_store(agent, env, timeout)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    else:  # another launcher: rank 0 serves a store at MASTER_ADDR:MASTER_PORT
        dist.init_process_group(backend, timeout=timeout)
    return device


def agent_store() -> dist.Store | None:
    """A client of the torchrun agent's store (it exists before any worker starts), or None without one."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=30), wait_for_workers=False)
    except (KeyError, ValueError, RuntimeError):
        return None


@functools.cache
def job_store(env: Env) -> dist.Store | None:
    """A store every rank of the job reaches before the process group exists: the agent's, or else (torchrun with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, another launcher) the one rank 0 serves at MASTER_ADDR:MASTER_PORT, which
    env:// then shares (multi-tenant); None for a single process. Cached: rank 0's server lives as long as the
    process."""
    if env.world_size == 1 or "MASTER_ADDR" not in os.environ:
        return None
    if (store := agent_store()) is not None:
        return store
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                             is_master=env.rank == 0, multi_tenant=True, wait_for_workers=False,
                             timeout=timedelta(seconds=30))
    except (KeyError, ValueError, RuntimeError):
        return None


def _round_store(agent: dist.Store, env: Env, timeout: timedelta) -> dist.Store:
    """A store born with this round of workers, for the process group's rendezvous.

    torchrun's agent keeps one store for its whole life, shared with its workers, and env:// uses it without a
    per-round prefix (pytorch/pytorch#135712: TORCHELASTIC_RESTART_COUNT, the old prefix, differs between nodes).
    Workers restarted after a failure, or after a node left or joined, read the dead workers' addresses there, and
    gloo fails in connectFullMesh with "Connection refused". So rank 0 serves a fresh store on a free port and posts
    the port in the agent's store, with a nonce it keeps inside the fresh store: a rank that read the previous
    round's post cannot connect (that store died with its rank 0) or finds another nonce, and reads again.
    """
    key, host = "torchtitan_lite/round_store", os.environ["MASTER_ADDR"]
    if env.rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = os.urandom(8).hex()
        store.set("nonce", nonce)
        agent.set(key, f"{store.port} {nonce}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, nonce = agent.get(key).decode().split()
        # A live store answers within milliseconds; a dead one's port is retried by the client until its timeout,
        # so a short one keeps a stale post (read before this round's rank 0 posted) from delaying the restart.
        with contextlib.suppress(RuntimeError):  # DistStoreError (a RuntimeError): no server there any more
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=0.5),
                                  wait_for_workers=False)
            if store.get("nonce").decode() == nonce:
                store.set_timeout(timeout)
                return store
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 of this round posted no store in {timeout.total_seconds():.0f} s")
        time.sleep(0.1)


_timeout = "comm.init_timeout_seconds"  # the option whose bound is in force, with its value once known
_train_timeout: timedelta | None = None


def set_timeout(seconds: int) -> None:
    """Every process group's collective timeout, for training (the mesh's subgroups took the start-up one)."""
    global _timeout, _train_timeout
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    _timeout, _train_timeout = f"comm.train_timeout_seconds = {seconds}", timedelta(seconds=seconds)


def train_timeout() -> timedelta | None:
    """The training timeout once set_timeout has put it in force, else None (the start-up one still bounds)."""
    return _train_timeout


def wait(works: list[dist.Work]) -> None:
    """Waits for point-to-point work (a pipeline's sends and receives) within the training timeout once it is set.
    A wait without one is bounded by the timeout gloo's connections had when the group was made (the start-up
    one, comm.init_timeout_seconds), which set_timeout does not change: a stopped peer would hold the job that long."""
    for work in works:
        work.wait(_train_timeout) if _train_timeout else work.wait()


# gloo's words for a collective that ran out of time: a wait on the whole operation, or one on a connection to a peer;
# or, in a group of more than two, a peer that ran out of time first and closed its connections to this rank; or a
# peer that died (its connections closed or reset by the system)
_GLOO_TIMEOUTS = ("Timed out", "Application timeout caused pair closure", "Connection closed by peer",
                  "Connection reset by peer")


def peer_timeout(error: BaseException) -> RuntimeError | None:
    """gloo's timeout as a message naming the cause and the bound, or None for any other error. (NCCL's watchdog
    ends the process itself after the same timeout, with its own message.) A pipeline stage raises its own error
    from gloo's ("[Stage 1] failed to run forward"), so the causes are read too."""
    causes = []
    while error is not None and error not in causes:
        causes.append(error)
        error = error.__cause__ or error.__context__
    message = next((m for m in map(str, causes) if any(t in m for t in _GLOO_TIMEOUTS)), "")
    at = min((message.index(m) for m in _GLOO_TIMEOUTS if m in message), default=None)
    if at is None:
        return None
    said = message[at:].splitlines()[0].split(". ")[0]  # without gloo's advice to read the other ranks' logs
    return RuntimeError(f"a collective waited longer than {_timeout} s: a peer rank is hung, stopped or dead "
                        f"(gloo: {said})")


def set_determinism(seed: int, deterministic: bool, device: torch.device, layout_invariant: bool = False) -> None:
    """The seed, and torch's deterministic algorithms where asked. Under training.layout_invariant on the CPU, one
    thread a process: the CPU's GEMM gives other bits with 2 threads than with 1 at some shapes
    (docs/layout_invariance.md), and a run of 1 process would otherwise have every core where each of N processes
    has a share."""
    torch.manual_seed(seed)
    if layout_invariant and device.type == "cpu":
        torch.set_num_threads(1)
    if deterministic:
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
