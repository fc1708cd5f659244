"""A hang that names its cause: which rank did not join which collective, and where in our step it was.

torch's flight recorder (TORCH_FR_BUFFER_SIZE entries per process; gloo records into it too since torch 2.9, NCCL
always did) keeps each collective this rank enqueued: its process group, sequence number in that group, op and Python
stack. When a collective times out, each surviving rank writes it to `<dump>/comm_traces/rank_<R>` (torchtitan's
names; NCCL's watchdog writes the same files itself, TORCH_NCCL_DUMP_ON_TIMEOUT) and posts a summary (the collective it
waited on and the point of the step it was at) in the store the error line goes through (errors.gather). The rank
that speaks names the ranks that posted nothing: stopped, hung or dead ranks cannot. gloo does not record
point-to-point ops, so a pipeline's sends and receives are named by the point alone.

The point is a plain attribute the step sets as it goes (`at`): no sync, no allocation, a few per block.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_lite.runtime import signals
from torchtitan_lite.runtime.errors import gather
from torchtitan_lite.runtime.process import Env, train_timeout

TRACES, PREFIX = "comm_traces", "rank_"  # torchtitan's comm.save_traces_folder and save_traces_file_prefix
DUMP_PATH = "TORCH_FR_DUMP_TEMP_FILE"  # where NCCL's watchdog writes (the rank is appended)
P2P = "a pipeline send/receive"
# Survivors of one stalled collective time out within moments of each other; ranks stalled behind them (a pipeline
# stage waiting on a stage that waits) a little later. The speaker waits this long for their posts, at most half a
# training timeout, so that the others, who wait a training timeout for its line, are still there to hear it.
_GATHER_S = 10.0

_point, _folder = "start-up", ""


def at(point: str) -> None:
    """Where this rank is in the step, named as the error line says it."""
    global _point
    _point = point


def enable(size: int, dump_folder: str) -> None:
    """Before the process group exists: record `size` collectives per rank (0: none), dumped to dump_folder's
    comm_traces/, made here: NCCL's watchdog writes its files there itself and creates no folder (the dump is lost
    without one)."""
    global _folder
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(size)  # torch's default is 2000 when unset: 0 must be said
    _folder = os.path.join(dump_folder, TRACES) if size > 0 else ""
    if size > 0:
        os.makedirs(_folder, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ[DUMP_PATH] = os.path.join(os.path.abspath(_folder), PREFIX)


@contextlib.contextmanager
def unseen_by_torchft() -> Iterator[None]:
    """Hides the dump path from torchft's Manager, built inside. Given one, it makes a folder beside it for every
    quorum (`comm_traces/rank__quorum_<id>`) and points the path into the newest: a folder per membership change,
    empty unless NCCL's watchdog dumps there, away from `comm_traces/rank_<R>`, where this module writes and the error
    line sends the reader. Without one it leaves the path alone."""
    path = os.environ.pop(DUMP_PATH, None)
    try:
        yield
    finally:
        if path is not None:
            os.environ[DUMP_PATH] = path


def mark_blocks(parts: list[nn.Module]) -> None:
    """Each transformer block names its forward, and its backward once its output's gradient arrives, before FSDP's
    hooks all-gather its weights: ours come first. (Not under compile: a compiled block traces its hooks into the
    graph, where a side effect runs after the block, not before.)"""
    for part in parts:
        for name, block in part.layers.items():
            block.register_forward_pre_hook(partial(_enter, f"the forward of block {name}"), prepend=True)
            block.register_forward_hook(partial(_leave, f"the backward of block {name}"), prepend=True)


def _enter(point: str, module: nn.Module, args: tuple) -> None:
    at(point)


def _leave(point: str, module: nn.Module, args: tuple, output) -> None:
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(partial(_backward, point))


def _backward(point: str, grad: torch.Tensor) -> None:
    at(point)  # and the gradient goes on unchanged


def _last_collective() -> dict:
    """This rank's newest recorded collective (its group's description, ranks and sequence number, and op), after
    writing the whole record to `<dump>/comm_traces/rank_<R>`; {} when recording is off."""
    if not _folder:
        return {}
    from torch._C._distributed_c10d import _dump_fr_trace

    trace = pickle.loads(_dump_fr_trace())
    groups = {name: group for group, name in dist.distributed_c10d._world.pg_names.items()}
    # gloo's record leaves out the groups' ranks, which torch's analyzer (flight_recorder.fr_trace) needs: ours
    trace["pg_config"] = {name: {"name": name, "desc": group.group_desc,
                                 "ranks": str(dist.get_process_group_ranks(group))} for name, group in groups.items()}
    os.makedirs(_folder, exist_ok=True)
    with open(os.path.join(_folder, f"{PREFIX}{dist.get_rank()}"), "wb") as f:
        pickle.dump(trace, f)
    if not trace["entries"]:
        return {}
    last = max(trace["entries"], key=lambda e: e["time_created_ns"])
    name, desc = last["process_group"]
    ranks = dist.get_process_group_ranks(groups[name]) if name in groups else []
    return {"op": last["profiling_name"].split(":")[-1], "seq": last["collective_seq_id"],
            "group": "world" if desc == "default_pg" else desc.removeprefix("mesh_"), "ranks": ranks}


def explain(error: RuntimeError, env: Env) -> RuntimeError:
    """`error` (a collective's timeout) with the ranks that did not join, the collective and the point of the step
    appended, pooled from every surviving rank; their flight records written."""
    mine = {"point": _point, **_last_collective()}
    if signals.stop_requested():  # torchrun stops the job: a worker failed, and torchrun's summary names it
        return error
    timeout = train_timeout()
    wait_s = min(_GATHER_S, timeout.total_seconds() / 2) if timeout else _GATHER_S
    posts = {rank: json.loads(post) for rank, post in gather(env, "hang", json.dumps(mine), wait_s).items()}
    return RuntimeError(f"{error}{diagnosis(posts, env.rank, env.world_size, _folder)}")


def diagnosis(posts: dict[int, dict], me: int, world_size: int, folder: str) -> str:
    """What the posts say: `; rank 2 did not join all_gather #13 of the dp_shard group (ranks 0-3), which rank 0
    waited on in the forward of block 1; flight records: FOLDER` ('' when every rank posted)."""
    silent = [rank for rank in range(world_size) if rank not in posts]
    if not silent:
        return ""
    mine = posts.get(me, {})
    point = mine.get("point", "an unknown point")
    if point == P2P or "op" not in mine:
        what = P2P if point == P2P else "a collective"
    else:
        what = f"{mine['op']} #{mine['seq']} of the {mine['group']} group ({_ranks(mine['ranks'])})"
        silent = [rank for rank in silent if not mine["ranks"] or rank in mine["ranks"]] or silent
    said = f"; {'ranks' if len(silent) > 1 else 'rank'} {_ranks(silent)} did not join {what}, which rank {me} waited " \
           f"on in {point}"
    records = f"; flight records of rank{'s' * (len(posts) > 1)} {_ranks(sorted(posts))} in {folder}"
    return said + (records if folder else "")


def _ranks(ranks: list[int]) -> str:
    """0, 1, 3 or 0-3."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
