"""train.py that records what a compiled run must prove: every parameter's full gradient at step 1, and how many
graphs torch.compile has built by each step.

    grad_dump.py OUT_DIR TRAIN_ARGS...  ->  OUT_DIR/grads.R.pt (rank R: canonical name -> full gradient before
                                            clipping, of R's pipeline stages' parameters: `load_grads` joins them)
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
from torchtitan_lite.models.llama import canonical_name

GRAD_DUMP = Path(__file__)


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
                    for model in models for n, p in model.named_parameters()}
            torch.save(full, out / f"grads.{os.environ.get('RANK', '0')}.pt")
        graphs.append(counters["stats"]["unique_graphs"])
        return clip(params, *args, **kwargs)

    train.parallelize, train.clip_grad_norm_ = recording_parallelize, recording_clip
    try:
        yield
    finally:
        train.parallelize, train.clip_grad_norm_ = parallelize, clip
        if int(os.environ.get("RANK", "0")) == 0:
            (out / "graphs.json").write_text(json.dumps(graphs))


def load_grads(out: Path) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient, from the ranks' files (ranks of the same pipeline stage wrote the same ones)."""
    grads = {}
    for f in sorted(out.glob("grads.*.pt")):
        for name, g in torch.load(f).items():
            grads[name] = None if g is None or grads.get(name, g) is None else g  # missing on any rank: missing
    return grads


def assert_grads_match(grads: dict, ref: dict, tolerance: float) -> None:
    """Every parameter has a gradient, within `tolerance` of its reference's largest element (relative)."""
    assert grads.keys() == ref.keys()
    worst = {}
    for name, g in grads.items():
        assert g is not None, f"{name} has no gradient"
        scale = ref[name].abs().max().item()
        assert scale > 0
        worst[name] = (g - ref[name]).abs().max().item() / scale
    name = max(worst, key=worst.get)
    print(f"worst relative gradient difference: {worst[name]:.2e} ({name})")
    assert worst[name] <= tolerance, f"{name}: {worst[name]:.2e}"


if __name__ == "__main__":
    with recording(Path(sys.argv[1])):
        code = train.run(sys.argv[2:])
    sys.exit(code)
