"""train.py that records what a compiled run must prove: every parameter's full gradient at step 1, and how many
graphs torch.compile has built by each step.

    grad_dump.py OUT_DIR TRAIN_ARGS...  ->  OUT_DIR/grads.R.pt (rank R, the first rank of its pipeline stages:
                                            canonical name -> full gradient before clipping, of those stages'
                                            parameters: `load_grads` joins them)
                                            OUT_DIR/graphs.json (rank 0: graphs built by each step's clipping)
                                            OUT_DIR/scales.R.pt (float8 runs: rank R's casts to float8 in step 1,
                                            each [role, its scale whole]: `load_scales`)
                                            OUT_DIR/routes.R.pt (mixture-of-experts runs: every token's experts in
                                            step 1, route_dump.py)
                                            OUT_DIR/arrivals.R.json (expert-parallel runs: the slots each dispatch
                                            brought rank R, by step)

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
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

import train
from route_dump import RouteRecorder, load_routes
from torchtitan_lite.runtime.run_history import read_metrics
from torchtitan_lite.models.init import canonical_name
from torchtitan_lite.parallel import expert_parallel

GRAD_DUMP = Path(__file__)


@contextlib.contextmanager
def recording(out: Path):
    models, graphs, scales, routes = [], [], ScaleRecorder(out), RouteRecorder(out)
    parallelize, clip, sharder = train.parallelize, train.clip_grad_norm_, train.sharder
    split, arrivals = expert_parallel.split_sizes, {}

    def recording_split(counts, received, slots):  # what a compiled run's graphs must take without recompiling
        send, recv = split(counts, received, slots)
        arrivals.setdefault(len(graphs) + 1, []).append(sum(recv))
        return send, recv

    def recording_parallelize(model, *args, **kwargs):
        models.append(model)
        scales.start(lambda: not graphs)  # float8 linears are converted by now
        routes.start(models, lambda: not graphs)
        return parallelize(model, *args, **kwargs)

    def recording_clip(params, *args, **kwargs):
        if not graphs:  # step 1
            full = {canonical_name(n): None if p.grad is None else
                    (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                    for model in models for n, p in model.named_parameters()}
            if (written := first_of_its_stages(full)) is not None:
                torch.save(written, out / f"grads.{os.environ.get('RANK', '0')}.pt")
        graphs.append(counters["stats"]["unique_graphs"])
        return clip(params, *args, **kwargs)

    def recording_sharder(*args, **kwargs):  # context parallelism's cut of the sequences, for the routes' positions
        share = sharder(*args, **kwargs)
        routes.ranges = share.keywords["ranges"] if share is not None else None
        return share

    train.parallelize, train.clip_grad_norm_, train.sharder = recording_parallelize, recording_clip, recording_sharder
    expert_parallel.split_sizes = recording_split
    try:
        yield
    finally:
        train.parallelize, train.clip_grad_norm_, train.sharder = parallelize, clip, sharder
        expert_parallel.split_sizes = split
        scales.stop()
        routes.stop()
        if arrivals:
            (out / f"arrivals.{os.environ.get('RANK', '0')}.json").write_text(json.dumps(arrivals))
        if int(os.environ.get("RANK", "0")) == 0:
            (out / "graphs.json").write_text(json.dumps(graphs))


class ScaleRecorder:
    """Every scale torchao casts a tensor to float8 with in step 1, whole (a DTensor's gathered), with the cast's
    role (input, weight, grad_output): where a layout scaled a shard by its own max, its scales are not one
    process's. Not the casts of a pipeline stage's shape inference, which runs it on stand-in tensors. A run without
    float8 records nothing."""

    def __init__(self, out: Path):
        self.out, self.scales, self.patched, self.inferring = out, [], [], False

    def start(self, first_step) -> None:
        if self.patched or "torchao.float8" not in sys.modules:
            return
        from torch.distributed.pipelining.stage import PipelineStage
        from torchao.float8.float8_training_tensor import _ToFloat8ConstrFunc

        forward = _ToFloat8ConstrFunc.forward

        def recording_forward(ctx, tensor, scale, float8_dtype, linear_mm_config, gemm_input_role, *args):
            # Not while torch.compile traces it: compiled blocks run their graph, not this function (unrecorded).
            if first_step() and not self.inferring and not torch.compiler.is_compiling():
                whole = scale.full_tensor() if isinstance(scale, DTensor) else scale
                self.scales.append((gemm_input_role.value, whole.detach().clone().reshape(-1)))
            return forward(ctx, tensor, scale, float8_dtype, linear_mm_config, gemm_input_role, *args)

        def inferring(method):
            def run(*args, **kwargs):
                self.inferring = True
                try:
                    return method(*args, **kwargs)
                finally:
                    self.inferring = False
            return run

        self.patched = [(_ToFloat8ConstrFunc, "forward", staticmethod(forward))]
        _ToFloat8ConstrFunc.forward = staticmethod(recording_forward)
        for name in ("_forward_metadata_inference", "_backward_metadata_inference"):
            self.patched.append((PipelineStage, name, getattr(PipelineStage, name)))
            setattr(PipelineStage, name, inferring(getattr(PipelineStage, name)))

    def stop(self) -> None:
        for owner, name, original in self.patched:
            setattr(owner, name, original)
        if self.patched:
            torch.save(self.scales, self.out / f"scales.{os.environ.get('RANK', '0')}.pt")


def load_scales(out: Path) -> dict[str, list[torch.Tensor]]:
    """role -> the scales of every rank's recorded casts."""
    found = {}
    for f in sorted(out.glob("scales.*.pt")):
        for role, scale in torch.load(f):
            found.setdefault(role, []).append(scale)
    return found


def first_of_its_stages(full: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None] | None:
    """What this rank writes of its stages' full gradients: None where a lower rank holds the same parameters (the
    ranks of one pipeline stage gather the same full gradients, a few MB each), else `full` with a parameter that has
    no gradient on any rank holding it as None, as load_grads reads it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return full
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, {name: g is not None for name, g in full.items()})
    if any(theirs.keys() == full.keys() for theirs in every[:dist.get_rank()]):
        return None
    return {name: g if all(theirs.get(name, True) for theirs in every) else None for name, g in full.items()}


def load_grads(out: Path) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient, from the files of the first rank of each pipeline stage (first_of_its_stages)."""
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


# What a step logs that is a function of the numbers alone (not of time or memory)
NUMBERS = ("loss", "grad_norm", "aux_loss", "router_z_loss", "routed_slots", "expert_load/")


def assert_same_bits(got: Path, ref: Path) -> None:
    """Two runs of one layout that must compute the same numbers (compiled and eager, checkpointed and not): every
    token's experts and margin at step 1, every parameter's gradient there, and every step's loss, grad norm, router
    losses and load (which DeepSeek-V3's bias is a function of), bit for bit."""
    routes, want = load_routes(got), load_routes(ref)
    assert want and routes.keys() == want.keys()
    for layer, sequences in want.items():
        assert routes[layer].keys() == sequences.keys(), layer
        for seq, (experts, margin) in sequences.items():
            assert torch.equal(routes[layer][seq][0], experts) and torch.equal(routes[layer][seq][1], margin), seq
    grads, ref_grads = load_grads(got), load_grads(ref)
    assert grads.keys() == ref_grads.keys()
    assert [n for n, g in grads.items() if g is None or not torch.equal(g, ref_grads[n])] == []

    def numbers(folder: Path) -> list[dict]:
        return [{k: v for k, v in m.items() if k.startswith(NUMBERS)} for m in read_metrics(folder) if "loss" in m]

    assert numbers(got) == numbers(ref)
    print(f"{got.name}: {len(want)} layers' routes, {len(grads)} gradients and {len(numbers(got))} steps' metrics "
          f"the bits of {ref.name}'s")


if __name__ == "__main__":
    with recording(Path(sys.argv[1])):
        code = train.run(sys.argv[2:])
    sys.exit(code)
