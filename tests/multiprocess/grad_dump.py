"""train.py that records what a compiled run must prove: every parameter's full gradient at step 1, and how many
graphs torch.compile has built by each step.

    grad_dump.py OUT_DIR TRAIN_ARGS...   ->   OUT_DIR/grads.pt (rank 0: canonical name -> gradient before clipping)
                                              OUT_DIR/graphs.json (rank 0: graphs built by each step's clipping)

The gradients are read where train.py clips them, after every micro-batch's backward: a parameter that autograd
never reached has no gradient there, or a zero one, and the test sees it. `recording(out)` does the same for a run
in this process.
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

import train
from torchtitan_lite.model import canonical_name


@contextlib.contextmanager
def recording(out: Path):
    models, graphs = [], []
    parallelize, clip = train.parallelize, train.clip_grad_norm_

    def recording_parallelize(model, *args, **kwargs):
        models.append(model)
        return parallelize(model, *args, **kwargs)

    def recording_clip(params, *args, **kwargs):
        if not graphs:  # step 1
            full = {canonical_name(n): None if p.grad is None else
                    (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                    for n, p in models[0].named_parameters()}
            if int(os.environ.get("RANK", "0")) == 0:
                torch.save(full, out / "grads.pt")
        graphs.append(counters["stats"]["unique_graphs"])
        return clip(params, *args, **kwargs)

    train.parallelize, train.clip_grad_norm_ = recording_parallelize, recording_clip
    try:
        yield
    finally:
        train.parallelize, train.clip_grad_norm_ = parallelize, clip
        if int(os.environ.get("RANK", "0")) == 0:
            (out / "graphs.json").write_text(json.dumps(graphs))


if __name__ == "__main__":
    with recording(Path(sys.argv[1])):
        code = train.run(sys.argv[2:])
    sys.exit(code)
