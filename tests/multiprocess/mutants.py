"""several_runs.py with one deliberate error in each run, named by the last part of its dump folder's name, which the
layout-invariant check must catch (test_layout_invariant.py):

    mutants.py RUNS_JSON   (several_runs.py's list of [dump folder, record, train args])

- "factor": one parameter's gradient times (1 + 2**-20) on every rank before clipping, at every step;
- "unreduced": rank 1 keeps its own piece of the step's first reduce-scatter instead of the ranks' sum;
- "flipped": the first routing's first token sent to another expert in place of its first choice.
"""

import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import train
from torchtitan_lite.models.common import moe
from torchtitan_lite.parallel.ordered_reduce import OrderedReduceScatter, tree_sum

FACTOR = 1 + 2 ** -20
error = {"kind": "", "calls": 0}  # the running run's, and how often its error's place has been reached


def error_of(argv: list[str]) -> str:
    return Path(argv[argv.index("--job.dump_folder") + 1]).name.rsplit("_", 1)[-1]


run = train.run


def run_with_error(argv, check=False):
    error.update(kind=error_of(argv), calls=0)
    return run(argv, check)


clip = train.clip_grad_norm_


def clip_with_factor(params, *args, **kwargs):
    if error["kind"] == "factor":
        params[1].grad.mul_(FACTOR)  # the first block's first weight (after the embedding)
    return clip(params, *args, **kwargs)


reduce_scatter = OrderedReduceScatter.__call__


def reduce_scatter_missing(self, output_tensor, input_tensor, group, op, async_op=False):
    if error["kind"] != "unreduced" or error["calls"] > 0:
        return reduce_scatter(self, output_tensor, input_tensor, group, op, async_op)
    error["calls"] += 1
    pieces = torch.empty_like(input_tensor)
    dist.all_to_all_single(pieces, input_tensor, group=group)  # every rank still takes part, none hangs
    every = pieces.view(dist.get_world_size(group), -1)
    mine = every[dist.get_rank(group)] if dist.get_rank() == 1 else tree_sum(list(every))
    output_tensor.copy_(mine.view_as(output_tensor))


route = moe.Router.forward


def route_flipped(router, x):
    weights, experts, scores, logits = route(router, x)
    if error["kind"] == "flipped" and error["calls"] == 0:
        error["calls"] += 1
        chosen = set(experts[0].tolist())
        experts = experts.clone()
        experts[0, 0] = next(e for e in range(router.args.num_experts) if e not in chosen)
    return weights, experts, scores, logits


train.run, train.clip_grad_norm_ = run_with_error, clip_with_factor
OrderedReduceScatter.__call__, moe.Router.forward = reduce_scatter_missing, route_flipped
runpy.run_path(str(Path(__file__).with_name("several_runs.py")), run_name="__main__")
