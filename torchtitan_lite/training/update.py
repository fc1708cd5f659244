"""The update: the optimizer step and everything that acts around it, one call a step.

In order: fp16's unscaling (so that the clip and the logged norm see the true gradients), the clip by the global
gradient norm, the learning rate the step uses, the decision to apply or skip the step, the step, the hooks that
follow every update and those that follow the first one only, the schedule's advance, the gradients freed.

Apply or skip is a vote. Each voter answers, on the device, whether this step must be skipped, and one vote to skip
is enough: the non-finite guard is one voter (runtime/precision.py), and another reason to skip a step is one line,
`update.votes.append(voter)`. The answers are combined on the device and handed to the optimizer as fused AdamW's
`found_inf` (precision.apply_or_skip), so no step waits for the host to decide. A voter must answer alike on every
rank, or the replicas drift apart: the guard reads the gradient norm, all-reduced over the whole job.

Before all of it, the commit: with replica groups (training/replicas.py) a step that failed in one of them is not
kept at all (no update, hook, count or schedule step) and is trained again, where a skipped step counts as a step.

Hooks are lists, as torch's optimizer hooks are, but ours run after every step, applied or skipped. torch's
post-hooks run inside optimizer.step(), which an optimizer without `found_inf` does not call for a skipped step: a
hook that all-reduces (float8's scale precompute) would then run on some steps only, and one that counts would miss
steps. A new concern acting after the update registers here; the loop does not change.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import torch

from torchtitan_lite.runtime.precision import UpdateGuard, apply_or_skip

# (the global gradient norm before clipping, the step) -> whether to skip the step's update: a bool on the device.
Voter = Callable[[torch.Tensor, int], torch.Tensor]


class Update:
    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                 guard: UpdateGuard, clip: Callable[[], torch.Tensor], commit: Callable[[], bool] = lambda: True):
        """`clip`: clips the gradients in place by their global norm and returns that norm (optim.clip_grad_norm_
        with its parameters bound). `commit`: whether the step is kept at all (replica groups: replicas.py)."""
        self.optimizer, self.scheduler, self.guard, self.clip, self.commit = optimizer, scheduler, guard, clip, commit
        self.votes: list[Voter] = [guard.vote]
        self.after_step: list[Callable[[], None]] = []
        self.after_first_step: list[Callable[[], None]] = []  # start-up's end: run once, then dropped
        self.lr = scheduler.get_last_lr()[0]

    def __call__(self, step: int) -> torch.Tensor | None:
        """Updates the weights from their gradients unless a voter skips it; returns the global gradient norm. A step
        not committed leaves no trace (no update, hook, count or schedule step; its gradients freed): None."""
        if not self.commit():
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.guard.unscale_(self.optimizer)
        grad_norm = self.clip()
        self.lr = self.scheduler.get_last_lr()[0]  # the rate this step used, for its log record
        apply_or_skip(self.optimizer, functools.reduce(operator.or_, (vote(grad_norm, step) for vote in self.votes)))
        for hook in [*self.after_step, *self.after_first_step]:
            hook()
        self.after_first_step.clear()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def fields(self) -> dict[str, float]:
        return {"lr": self.lr}
