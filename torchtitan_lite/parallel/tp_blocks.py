"""Tensor parallelism's order of sums on a layout without TP (training.layout_invariant): the model's TP plan applied
by a second implementation of its styles, which compute every sum TP 2 splits in TP 2's 2 blocks, so that a layout
with TP 2 (sequence and loss parallel) and one without give the same bits.

- colwise: the output's 2 halves from a fork of the input, whose backward adds the halves' input gradients (the
  all-gather's reduce-scatter); a prepare_input's module forks once for all its colwise children (q, k, v);
- rowwise: the products of the input's and weight's 2 K halves, added (the reduce-scatter's sum);
- sequence: the norm on the 2 sequence halves, whose weight gradients autograd adds;
- the loss: loss parallel's cross-entropy on the 2 vocabulary halves (`blocked_cross_entropy`, step.Numerics);
- the embedding: nothing (a vocabulary-parallel lookup adds zeros to the owner's row).
Each block's GEMM and kernel then has the shapes a tp rank's has; attention runs every head at once, which gives each
head's bits (docs/layout_invariance.md has the probes). With token_blocks 2 (training.layout_invariant_cp 2,
cp_blocks.py) every style computes on each of CP 2's token halves apart, as each cp rank does.
"""

from __future__ import annotations

import fnmatch
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.models.spec import TPStyles

BLOCKS = 2  # TP 2's: its collectives add 2 terms, one addition in either order


class Fork(torch.autograd.Function):
    """x as BLOCKS inputs, one per tp rank; backward adds their gradients (2: one addition)."""

    @staticmethod
    def forward(ctx, x):
        return tuple(x.view_as(x) for _ in range(BLOCKS))

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for g in grads:
            if g is not None:
                total = g if total is None else total + g
        return total


def _style(kind: str):
    return lambda *args, **kwargs: (kind, kwargs)


STYLES = TPStyles(_style("colwise"), _style("rowwise"), _style("prepare_input"), _style("sequence"),
                  _style("embedding"), _style("replicated"))


def apply_blocks(model: nn.Module, tp_plan, token_blocks: int = 1) -> None:
    """`tp_plan` (the model spec's) applied to `model` in blocks, on one rank: the plan's names select the modules.
    `token_blocks` 2 (cp_blocks.py): each module computes on each of CP 2's token halves apart, stacked on the batch
    dim, as each cp rank does; then the plan must name every module holding parameters."""
    plan = tp_plan(STYLES, True)
    names = dict(model.named_modules())
    tokens = Tokens(token_blocks)
    covered = set()
    for pattern, (kind, kwargs) in plan.items():
        for name in fnmatch.filter(names, pattern):
            module = names[name]
            covered.add(module)
            if kind == "colwise":
                _colwise(module, names.get(name.rsplit(".", 1)[0]) if "." in name else None, tokens)
            elif kind == "rowwise":
                _rowwise(module, tokens)
            elif kind == "sequence":
                _sequence(module, kwargs.get("sequence_dim", 1), tokens)
            elif kind == "embedding" and token_blocks > 1:
                _tokenwise(module, tokens)
            elif kind == "prepare_input" and name.endswith(("attention", "feed_forward")):
                module.register_forward_pre_hook(partial(_fork_input, tokens=tokens))
                module.register_forward_hook(_drop_fork)
    if token_blocks > 1 and (missed := [n for n, m in names.items()
                                        if m not in covered and any(True for _ in m.parameters(recurse=False))]):
        raise ValueError(f"CP 2's token halves cover the modules the TP plan names, and {missed[0]} holds parameters "
                         "the plan does not name")


class Tokens:
    """How a module's input splits into token blocks: CP 2's halves, stacked on the batch dim, or one block."""

    def __init__(self, blocks: int):
        self.blocks = blocks

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.chunk(self.blocks, 0) if self.blocks > 1 else (x,)

    def join(self, outs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(outs, 0) if self.blocks > 1 else outs[0]


def _fork_input(module: nn.Module, args: tuple, tokens: Tokens) -> None:
    """TP gathers the module's input once for its column-parallel children: they share one fork per token block."""
    x = args[0]
    module._tp_fork = (x, [Fork.apply(h) for h in tokens.split(x)])


def _drop_fork(module: nn.Module, args: tuple, output) -> None:
    """The fork is its forward's alone: not held, with the input it forked, until the next forward."""
    module._tp_fork = None


def _colwise(module: nn.Linear, parent: nn.Module | None, tokens: Tokens) -> None:
    """`parent`'s forks where it forked this input (a prepare_input's module), else forks of its own (the output)."""
    def forward(x):
        fork = getattr(parent, "_tp_fork", None)
        forks = fork[1] if fork is not None and fork[0] is x else [Fork.apply(h) for h in tokens.split(x)]
        return tokens.join([torch.cat([F.linear(x_b, w_b.contiguous())
                                       for x_b, w_b in zip(inputs, module.weight.chunk(BLOCKS, 0))], -1)
                            for inputs in forks])
    module.forward = forward


def _rowwise(module: nn.Linear, tokens: Tokens) -> None:
    def block(x):
        parts = [F.linear(x_b.contiguous(), w_b.contiguous())
                 for x_b, w_b in zip(x.chunk(BLOCKS, -1), module.weight.chunk(BLOCKS, 1))]
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total
    module.forward = lambda x: tokens.join([block(h) for h in tokens.split(x)])


def _sequence(module: nn.Module, dim: int, tokens: Tokens) -> None:
    forward = module.forward

    def blocked(x):
        return torch.cat([forward(x_b.contiguous()) for x_b in x.chunk(BLOCKS, dim)], dim)
    module.forward = blocked if tokens.blocks == 1 else _grouped(module, blocked, tokens)


def _grouped(module: nn.Module, forward, tokens: Tokens):
    """`forward` on each token block with the module's parameters as aliases of their own: a block's uses of a
    weight (the sequence blocks' norms) add up apart, as a cp rank's do, before autograd adds the blocks'."""
    inside = []

    def grouped(x):
        if inside:  # the call functional_call makes, with the aliases in place
            return forward(x)
        inside.append(True)
        try:
            outs = []
            for h in tokens.split(x):
                aliases = {name: p.view_as(p) for name, p in module.named_parameters(recurse=False)}
                outs.append(torch.func.functional_call(module, aliases, (h,)))
            return tokens.join(outs)
        finally:
            inside.clear()
    return grouped


def _tokenwise(module: nn.Module, tokens: Tokens) -> None:
    forward = module.forward
    module.forward = lambda x: tokens.join([forward(h) for h in tokens.split(x)])


class _BlockedCE(torch.autograd.Function):
    """torch's loss parallel (distributed/tensor/parallel/loss.py) on BLOCKS vocabulary halves of (N, V) logits:
    the sum over tokens of -log_softmax at the target, and its fused backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        halves = [h.contiguous() for h in x.chunk(BLOCKS, 1)]
        x_max = torch.amax(halves[0], 1, keepdim=True)
        for h in halves[1:]:
            x_max = torch.maximum(x_max, torch.amax(h, 1, keepdim=True))
        shifted = [h - x_max for h in halves]
        sumexp = None
        for s in shifted:
            part = torch.sum(torch.exp(s), 1, keepdim=True)
            sumexp = part if sumexp is None else sumexp + part
        lse = torch.log(sumexp)
        logp = [s - lse for s in shifted]
        width = halves[0].shape[1]
        picked = torch.zeros(x.shape[0], 1, dtype=x.dtype, device=x.device)
        for b, lp in enumerate(logp):
            local = target - b * width
            owned = (local >= 0) & (local < width)
            value = torch.gather(lp, 1, torch.where(owned, local, 0).unsqueeze(1))
            picked = picked + torch.where(owned.unsqueeze(1), value, 0)
        result = -picked.squeeze(1)
        ctx.save_for_backward(*logp, target)
        return result.sum()

    @staticmethod
    def backward(ctx, grad_output):
        *logp, target = ctx.saved_tensors
        width = logp[0].shape[1]
        grads = []
        for b, lp in enumerate(logp):
            local = target - b * width
            owned = (local >= 0) & (local < width)
            grad_input = torch.zeros_like(lp)
            rows = torch.arange(lp.shape[0], device=lp.device)
            # torch's: -1 at a target this block holds, 0 written elsewhere (its mask minus 1)
            grad_input[rows, torch.where(owned, local, 0)] = (~owned).to(lp.dtype) - 1.0
            go = grad_output.expand(lp.shape[0], 1)
            grads.append((grad_input + torch.exp(lp)) * go)
        return torch.cat(grads, 1), None


def blocked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed token losses of (N, V) `logits`, as loss parallel over 2 ranks computes them."""
    return _BlockedCE.apply(logits, labels)
