"""Deliberate errors, which the layout-invariant check must catch (test_layout_invariant.py): `made_wrong(kind)` puts
one into the trainer of this process while it is open.

- "factor": one parameter's gradient times (1 + 2**-20) on every rank before clipping, at every step;
- "unreduced": rank 1 keeps its own piece of the step's first reduce-scatter instead of the ranks' sum;
- "flipped": the first routing's first token sent to another expert in place of its first choice.

As a script, several_runs.py with the error that the last part of each run's dump folder name says:

    mutants.py RUNS_JSON   (several_runs.py's list of [dump folder, record, train args])
"""

import contextlib
import runpy
from pathlib import Path

import torch
import torch.distributed as dist

import train
from torchtitan_lite.models.common import moe
from torchtitan_lite.parallel.ordered_reduce import OrderedReduceScatter, tree_sum

FACTOR = 1 + 2 ** -20


@contextlib.contextmanager
def made_wrong(kind: str):
    clip, reduce_scatter, route = train.clip_grad_norm_, OrderedReduceScatter.__call__, moe.Router.forward
    reached = []  # the error's place, each time it was reached

    def clip_with_factor(params, *args, **kwargs):
        reached.append(True)
        params[1].grad.mul_(FACTOR)  # the first block's first weight (after the embedding)
        return clip(params, *args, **kwargs)

    def reduce_scatter_missing(self, output_tensor, input_tensor, group, op, async_op=False):
        if reached:
            return reduce_scatter(self, output_tensor, input_tensor, group, op, async_op)
        reached.append(True)
        pieces = torch.empty_like(input_tensor)
        dist.all_to_all_single(pieces, input_tensor, group=group)  # every rank still takes part, none hangs
        every = pieces.view(dist.get_world_size(group), -1)
        mine = every[dist.get_rank(group)] if dist.get_rank() == 1 else tree_sum(list(every))
        output_tensor.copy_(mine.view_as(output_tensor))

    def route_flipped(router, x):
        weights, experts, scores, logits = route(router, x)
        if not reached:
            reached.append(True)
            chosen = set(experts[0].tolist())
            experts = experts.clone()
            experts[0, 0] = next(e for e in range(router.args.num_experts) if e not in chosen)
        return weights, experts, scores, logits

    owner, name, wrong = {"factor": (train, "clip_grad_norm_", clip_with_factor),
                          "unreduced": (OrderedReduceScatter, "__call__", reduce_scatter_missing),
                          "flipped": (moe.Router, "forward", route_flipped)}[kind]
    original = getattr(owner, name)
    setattr(owner, name, wrong)
    try:
        yield
    finally:
        setattr(owner, name, original)
    assert reached, f"the {kind} error was never reached"


if __name__ == "__main__":
    run = train.run

    def run_made_wrong(argv, check=False):
        with made_wrong(Path(argv[argv.index("--job.dump_folder") + 1]).name.rsplit("_", 1)[-1]):
            return run(argv, check)

    train.run = run_made_wrong
    runpy.run_path(str(Path(__file__).with_name("several_runs.py")), run_name="__main__")
