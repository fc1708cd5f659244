"""torch.compile, block by block (parallelize.py applies it after activation checkpointing, before FSDP).

A block compiles whole: one graph (fullgraph), in place, so its parameter names stay unchanged, and with its
activation checkpointing inside the graph. A mixture of experts under expert parallelism cannot be traced so: its
dispatch reads the all-to-all's split sizes on the host (all_to_all_single takes integers), and its experts are an
FSDP unit of their own, whose hooks dynamo does not trace. So there the block compiles in pieces around them, as
torchtitan does: each of its other modules (the norms, attention, the shared experts) one graph, its forward compiled
and not its call, so that the module's hooks (FSDP's, TP's) run outside; and the experts' grouped GEMM on the slots
that arrived (parallel/expert_parallel.py), one graph for every layer, the number of slots dynamic, so that the split
sizes, which change every step, compile nothing after the first. The router stays eager, its gate an FSDP unit of its
own that gathers in fp32 as in eager runs, and so do the sort, the losses and the load counting around the experts,
which then compute exactly as eagerly. Activation checkpointing wraps such a block from outside, eagerly, and
recomputes its compiled pieces.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchtitan_lite.models.common.moe import MoE, swiglu_experts
from torchtitan_lite.models.spec import blocks


def apply_compile(model: nn.Module, backend: str, around_dispatch: bool) -> None:
    """Each block of `model` compiled whole, or in pieces where `around_dispatch` and it holds a mixture of experts."""
    for block in blocks(model):
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        if not (around_dispatch and isinstance(getattr(inner, "moe", None), MoE)):
            block.compile(backend=backend, fullgraph=True)
            continue
        pieces = [m for name, m in inner.named_children() if name != "moe"]
        for piece in [*pieces, inner.moe.shared_experts]:
            if piece is not None:
                piece.forward = torch.compile(piece.forward, backend=backend, fullgraph=True)


def compiled_experts(backend: str) -> Callable:
    """moe.swiglu_experts compiled, its slots' count dynamic from the first call: what expert parallelism computes
    on the slots that arrived (apply_ep's `compute`)."""
    compiled = torch.compile(swiglu_experts, backend=backend, fullgraph=True)

    def compute(x: torch.Tensor, counts: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(x, 0)  # "maybe": a rank that received 0 or 1 slots gets a graph of its own
        return compiled(x, counts, *weights)

    return compute
