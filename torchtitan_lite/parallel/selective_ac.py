"""Op-level selective activation checkpointing (`activation_checkpoint.selective_ac_option op`): which ops' outputs a
recomputed block keeps, and the dispatch modes torch's checkpoint runs the block's forward and recompute under.

Kept: what is costly to recompute or must not run twice. The matmuls and attention, and, as torchtitan keeps them,
the collectives' outputs: expert parallelism's all-to-alls (the counts, the slots out and back), which a recompute
would otherwise run again in backward, waiting there on every ep rank, and TP's reduce-scatters; and a copy from a
device to the host (the split sizes the EP dispatch reads: on a GPU a recompute would wait for the device again).
Everything else, element-wise and cheap, is recomputed.

torch 2.13 replays a block's ops by their order: the recompute's i-th call of an op takes the i-th call's place from
the forward, and a call the forward did not make is an error. An FSDP unit inside a block (the routed experts under
expert parallelism, the mixture under TP, a router gate gathered in fp32 under bf16: parallelize.py) runs other ops
in its hooks when the block is recomputed: in forward it gathers its weights and frees them after, in the recompute
it gathers them for backward and keeps them. So the ops of such a unit's hooks pass through both modes uncounted
(`uncount_inner_units`), as pytorch/pytorch#196862 does upstream after 2.13; the block's own ops are counted as
before, the unit's forward among them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import CheckpointPolicy, _CachedTorchDispatchMode, _CachingTorchDispatchMode

COLLECTIVES = (torch.ops._c10d_functional.all_to_all_single.default,
               torch.ops._c10d_functional.reduce_scatter_tensor.default)


def must_save(op, args, kwargs, keep) -> bool:
    """Whether op-level checkpointing keeps this op's output: an op of `keep` (the matmuls, attention, COLLECTIVES),
    or a copy from a device to the host."""
    if op in keep:
        return True
    return (op is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
            and args[0].device.type != "cpu" and torch.device(kwargs.get("device") or args[0].device).type == "cpu")


def policy_keeping(keep: tuple) -> Callable:
    """The checkpoint policy that saves what `must_save` says and prefers recomputing the rest."""
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if must_save(op, args, kwargs, keep) else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


_in_unit_hooks = [0]  # how deep the running code is in an inner FSDP unit's hooks (uncount_inner_units)


class _Saving(_CachingTorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _in_unit_hooks[0]:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Replaying(_CachedTorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _in_unit_hooks[0]:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def contexts(policy) -> tuple[_Saving, _Replaying]:
    """torch.utils.checkpoint.create_selective_checkpoint_contexts(policy), with the inner units' hooks uncounted."""
    storage = defaultdict(dict)
    return _Saving(policy, storage), _Replaying(None, storage)


def uncount_inner_units(blocks: list[nn.Module]) -> None:
    """Every FSDP unit inside a block (not the block's own) runs its forward hooks outside the selective
    checkpoint's count. Called after FSDP is applied: FSDP puts its pre-forward hook first and its post-forward hook
    last, so these go around them."""
    def enter(*_):
        _in_unit_hooks[0] += 1

    def leave(*_):
        _in_unit_hooks[0] -= 1

    for block in blocks:
        for unit in block.modules():
            if unit is not block and isinstance(unit, FSDPModule):
                unit.register_forward_pre_hook(enter, prepend=True)
                unit.register_forward_pre_hook(leave)
                unit.register_forward_hook(enter, prepend=True)
                unit.register_forward_hook(leave)
