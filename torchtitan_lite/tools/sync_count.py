"""Every host-device sync of a run's training steps, with the line of ours that asked for it (what
benchmarks/sync_count.py and the tests run train.py under).

    main(train.run, [OUT_DIR, TRAIN_ARGS...])   ->   OUT_DIR/syncs-RANK.json: {step: ["file:function@device", ...]}

A sync is an op whose result the host must wait for: reading a tensor's values (`.item()`, `.tolist()`, `bool(t)`,
`if t:`), or an op whose output shape depends on values (nonzero). A TorchDispatchMode sees each one as it is dispatched, on any
device; on a GPU device-to-host copies (`.cpu()`, `.tolist()`) sync too, and the trainer's step makes none. So does
a copy to the GPU from pageable host memory (the host first waits for the device's queued work): recorded as
`file:function:copy@cuda`; batches come pinned and are copied with non_blocking, so a GPU step makes none.
"""

import json
import os
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_lite.data.loader import DataLoader

ROOT = Path(__file__).resolve().parents[2]  # beside the package: train.py, in a checkout and installed alike
OURS = (str(ROOT / "train.py"), str(ROOT / "torchtitan_lite"))
aten = torch.ops.aten
SYNCS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default, aten.equal.default}
COPIES = {aten._to_copy.default, aten.copy_.default}
# Reads of host tensors by design, which wait for no device on a GPU machine either (gloo's): the preemption flag
# every step, the stragglers' step times at logging steps. On the CPU they look like any other read.
HOST_READS = ("signals.py:requested@cpu", "stragglers.py:<genexpr>@cpu")


def waiting_upload(func, args, kwargs) -> bool:
    """A host-to-GPU copy the host must wait for: from pageable memory, or without non_blocking."""
    if func is aten._to_copy.default:
        src, target, non_blocking = args[0], kwargs.get("device"), kwargs.get("non_blocking", False)
    else:
        (target, src), non_blocking = args[:2], (args[2:] or [kwargs.get("non_blocking", False)])[0]
        target = target.device
    return (target is not None and torch.device(target).type == "cuda" and src.device.type == "cpu"
            and not (non_blocking and src.is_pinned()))


def call_site() -> str:
    """Our innermost frame on the stack: what asked for the value."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(OURS) and frame.filename != __file__:  # the recorder's own frames are not a site
            return f"{Path(frame.filename).name}:{frame.name}"
    return "elsewhere"


class SyncRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.step, self.syncs = 0, defaultdict(list)
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        # `.tolist()` reads a tensor's values without dispatching an op on the CPU: seen here, as on a GPU it syncs.
        recorder, tolist = self, self._tolist

        def recorded_tolist(t):
            if not isinstance(t, DTensor):
                recorder.syncs[recorder.step].append(f"{call_site()}@{t.device.type}")
            return tolist(t)

        torch.Tensor.tolist = recorded_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # let DTensor desugar the op first: what it syncs on then comes through here
        if func in SYNCS:
            self.syncs[self.step].append(f"{call_site()}@{args[0].device.type}")
        elif func in COPIES and waiting_upload(func, args, kwargs or {}):
            self.syncs[self.step].append(f"{call_site()}:copy@cuda")
        return func(*args, **(kwargs or {}))


def main(run: Callable[[list[str]], int], argv: list[str]) -> int:
    """run(TRAIN_ARGS) (train.run) with every sync from its first step on recorded; returns run's exit code."""
    out, train_args = Path(argv[0]), argv[1:]
    recorder, next_batch = SyncRecorder(), DataLoader.next_batch

    def counting_next_batch(self):
        if recorder.step == 0:
            recorder.__enter__()  # from the first step on: start-up's syncs are not the loop's
        recorder.step += 1
        return next_batch(self)

    DataLoader.next_batch = counting_next_batch
    code = run(train_args)
    recorder.__exit__(None, None, None)
    (out / f"syncs-{os.environ['RANK']}.json").write_text(json.dumps(recorder.syncs))
    return code
