"""The collectives of one whole training step, for several layouts in one launch (what benchmarks/comm_count.py and
the tests run train.py under).

    main(train, [OUT_DIR, '{"name": [overrides...], ...}', TRAIN_ARGS...])   ->   OUT_DIR/name.json (rank 0)

Each layout is a run of train.run with TRAIN_ARGS and its overrides, one after another in the same processes. During
its step 2 (step 1 differs: it compiles nothing here, but it alone logs and measures memory) a TorchDispatchMode
sees every collective as it is dispatched: c10d's (FSDP2's all-gathers and reduce-scatters, HSDP's and the grad
norm's all-reduces) and the functional ones (DTensor's TP redistributes). Each is recorded as [kind, the group's
ranks, bytes], the bytes being the full buffer (what an all-gather outputs, what a reduce-scatter or all-reduce takes
in, what an all-to-all sends).
"""

import json
import os
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_lite.data.loader import DataLoader

c10d, funcol = torch.ops.c10d, torch.ops._c10d_functional


def ranks(group) -> list[int]:
    """The global ranks of a group: which mesh dimension a collective runs over. c10d ops carry the group as a
    TorchScript object, functional ones by name."""
    group = dist.ProcessGroup.unbox(group) if not isinstance(group, str) else _resolve_process_group(group)
    return dist.get_process_group_ranks(group)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in (tensors if isinstance(tensors, (list, tuple)) else [tensors]))


# op -> (kind, (args) -> (group size, bytes))
COLLECTIVES = {
    c10d._allgather_base_.default: ("all_gather", lambda a: (ranks(a[2]), nbytes(a[0]))),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", lambda a: (ranks(a[2]), nbytes(a[1]))),
    c10d.allreduce_.default: ("all_reduce", lambda a: (ranks(a[1]), nbytes(a[0]))),
    funcol.all_gather_into_tensor.default: ("all_gather", lambda a: (ranks(a[2]), nbytes(a[0]) * a[1])),
    funcol.reduce_scatter_tensor.default: ("reduce_scatter", lambda a: (ranks(a[3]), nbytes(a[0]))),
    funcol.all_reduce.default: ("all_reduce", lambda a: (ranks(a[2]), nbytes(a[0]))),
    # Expert parallelism's: the counts' exchange (c10d) and the tokens' (functional); the bytes a rank sends.
    c10d.alltoall_base_.default: ("all_to_all", lambda a: (ranks(a[2]), nbytes(a[1]))),
    funcol.all_to_all_single.default: ("all_to_all", lambda a: (ranks(a[3]), nbytes(a[0]))),
}
NOT_COLLECTIVES = {funcol.wait_tensor.default, funcol._wrap_tensor_autograd.default}


class CommRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # let DTensor desugar the op first: its collectives then come through here
        if func in COLLECTIVES:
            kind, measure = COLLECTIVES[func]
            self.calls.append([kind, *measure(args)])
        elif func.namespace in ("c10d", "_c10d_functional") and func not in NOT_COLLECTIVES:
            self.calls.append([str(func), [], 0])  # any other collective: the test fails on it
        return func(*args, **(kwargs or {}))


def main(train: ModuleType, argv: list[str]) -> int:
    """Each layout's train.run in turn, its step 2 recorded; `train` is train.py's module (passed in: it sits above
    the package). Returns 1 when a run fails, else 0."""
    out, layouts, train_args = Path(argv[0]), json.loads(argv[1]), argv[2:]
    next_batch, state = DataLoader.next_batch, {}

    def recording_next_batch(self):
        if "recorder" in state:  # the start of step 3: step 2 is over
            state.pop("recorder").__exit__(None, None, None)
        state["step"] = state.get("step", 0) + 1
        if state["step"] == 2:
            state["recorder"] = CommRecorder().__enter__()
            state["calls"] = state["recorder"].calls
        return next_batch(self)

    # One process group for all the runs: train.run would make and destroy one each time, and a group made again in
    # the same processes can meet the previous one's keys in the store. Each run still builds its own mesh and
    # subgroups.
    init_distributed, destroy = train.init_distributed, dist.destroy_process_group
    train.init_distributed = lambda *a, **k: torch.device("cpu") if dist.is_initialized() else init_distributed(*a, **k)
    dist.destroy_process_group = lambda *a, **k: None
    DataLoader.next_batch = recording_next_batch
    for name, overrides in layouts.items():
        state.clear()
        if train.run([*train_args, "--job.dump_folder", str(out / name), *overrides]) != 0:
            return 1
        if os.environ["RANK"] == "0":
            (out / f"{name}.json").write_text(json.dumps(state["calls"]))
    dist.barrier()
    destroy()
    return 0
