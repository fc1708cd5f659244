"""Expert parallelism: a mixture of experts' routed experts split across the ep ranks, tokens sent to them and back.

The ep ranks are borrowed from the ranks that route different tokens, dp_shard x cp x tp (ParallelDims.experts_mesh):
each holds different tokens, as under FSDP, and E / ep of the experts (experts_mesh's "ep" dim, a Shard(0) of the 3-D
weights), FSDP-sharded further over the rest of them ("efsdp"). A layer's router and sort run on each rank's own tokens,
unchanged; the experts' forward becomes:
1. dispatch: the per-expert counts are exchanged (all-to-all), so each rank learns how many slots every rank sends it
   for each of its experts; one host read of the split sizes (all_to_all_single takes them as integers); the slots
   travel by an uneven all-to-all, arriving grouped by source rank, and are regrouped by expert;
2. the experts' computation of models/common/moe.py (swiglu_experts), on this rank's experts and their slots;
3. combine: the inverse regrouping and all-to-all bring every slot back to the rank and position it came from.
Every slot meets the same expert weights in a group of the same expert as on one process, so its arithmetic is the
same; its gradient returns by the autograd of the same all-to-alls. The loss is normalized by the global token count
and gradients are summed across data-parallel ranks (parallelize.apply_fsdp), so the experts' gradients, summed over
the ep ranks' tokens by the all-to-all's backward and then over efsdp by FSDP, need no factor of the EP degree.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from torchtitan_lite.models.common.moe import GroupedExperts, swiglu_experts


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, compute: Callable = swiglu_experts,
             per_source: bool = False) -> list[nn.Module]:
    """Every GroupedExperts of `model` (on the meta device) split over `ep_mesh` (1-D): its weights become DTensors
    holding this rank's experts, its forward the dispatch, `compute` (swiglu_experts, or its compiled graph:
    parallel/compile.py) and combine. With `per_source` (training.layout_invariant) the experts compute each source
    rank's slots apart, as that rank's micro-batch alone would on one process: the same GEMMs, and each expert's
    weight gradient a sum of the sources' (2 of them: one addition, in either order the same). Returns the modules."""
    n, rank, group = ep_mesh.size(), ep_mesh.get_local_rank(), ep_mesh.get_group()
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for module in experts:
        for name, param in list(module.named_parameters(recurse=False)):
            local = param.detach().chunk(n)[rank]
            module.register_parameter(name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)],
                                                                            run_check=False)))
        module.forward = functools.partial(_forward, module, group, n, compute, per_source)
    return experts


def _forward(module: GroupedExperts, group: dist.ProcessGroup, n: int, compute: Callable, per_source: bool,
             x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """GroupedExperts.forward under expert parallelism: `x`, this rank's slots sorted by expert (all E experts),
    counts[e] of them for expert e; returns their outputs in the same order."""
    local_experts = counts.numel() // n
    # received[i, e]: the slots rank i sends for this rank's e-th expert. A functional collective, not c10d's
    # in-place one: op-level checkpointing saves its output (parallel/selective_ac.py), where a recompute would lose
    # the write into an empty tensor.
    received = wait_tensor(all_to_all_single(counts, None, None, group)).view(n, local_experts)
    send, recv = split_sizes(counts, received, x.shape[0])
    arrived = all_to_all_single_autograd(x, recv, send, group)
    weights = [w.to_local() if isinstance(w, DTensor) else w for w in (module.w1, module.w2, module.w3)]
    if per_source:  # each source's block arrives sorted by expert already
        back = torch.cat([compute(block, received[i], *weights, module.grouped_mm)
                          for i, block in enumerate(arrived.split(recv))])
    else:
        order = regroup_by_expert(received, sum(recv))
        out = compute(arrived[order], received.sum(0), *weights, module.grouped_mm)
        back = torch.empty_like(out).index_copy(0, order, out)
    return all_to_all_single_autograd(back, send, recv, group)


def split_sizes(counts: torch.Tensor, received: torch.Tensor, slots: int) -> tuple[list[int], list[int]]:
    """The slots this rank sends to each ep rank, and receives from each: from its counts per expert (all E), of
    `slots` in all, and `received` (ep ranks, local experts). Read on the host, since all_to_all_single takes integers:
    the dispatch's one device sync (the memory estimate, whose fake tensors hold no counts, splits `slots` evenly)."""
    n, local_experts = received.shape
    send, recv = torch.stack([counts.view(n, local_experts).sum(1), received.sum(1)]).tolist()
    return send, recv


def regroup_by_expert(sizes: torch.Tensor, total: int) -> torch.Tensor:
    """The order that takes slots arriving in blocks (source rank i, expert e), of sizes[i, e] rows each, in that
    order, to blocks (e, i): row j of the regrouped slots is row order[j] of the arrived ones. Computed on the
    device, without reading the sizes: `total`, their sum, is known."""
    arrival_start = (sizes.flatten().cumsum(0) - sizes.flatten()).view_as(sizes).t().flatten()
    by_expert = sizes.t().flatten()
    start = by_expert.cumsum(0) - by_expert
    offset = torch.arange(total, device=sizes.device) - start.repeat_interleave(by_expert, output_size=total)
    return arrival_start.repeat_interleave(by_expert, output_size=total) + offset
