"""Validation: the loss on held-out data every `validation.freq` steps and at the last step.

Each validation reads `validation.steps` global batches from the start of each held-out source, through a loader
made anew: the same batches every time, so two validations differ only by the weights. One source logs `val_loss`; a
mixture's log `val_loss/NAME` each and `val_loss` over all their tokens, the mean of theirs since each has as many.
One all-reduce and one read of the device for all of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan_lite.config import Validation as ValidationConfig
from torchtitan_lite.data.loader import DataLoader
from torchtitan_lite.training.step import Step


class Validation:
    def __init__(self, cfg: ValidationConfig, sources: dict, loader_args: tuple, model_step: Step, global_tokens: int,
                 loss_group: dist.ProcessGroup, last_step: int):
        """`sources`: the held-out sources by name ("" for the training data's own); `loader_args`: the training
        loader's after its source, so that each rank reads its share of the same global batches."""
        self.cfg, self.sources, self.loader_args, self.step = cfg, sources, loader_args, model_step
        self.tokens, self.group, self.last_step = global_tokens * cfg.steps, loss_group, last_step

    def due(self, step: int) -> bool:
        return self.cfg.enable and (step % self.cfg.freq == 0 or step == self.last_step)

    def __call__(self) -> dict[str, float]:
        """The fields to log: val_loss, and a mixture's val_loss/NAME."""
        loaders = {name: DataLoader(source, *self.loader_args) for name, source in self.sources.items()}
        steps = self.cfg.steps
        losses = torch.stack([self.step.eval_step((batch for _ in range(steps) for batch in loader.next_batch()),
                                                  self.tokens) for loader in loaders.values()])
        dist.all_reduce(losses, group=self.group)
        values = dict(zip(loaders, losses.tolist()))
        return {"val_loss": sum(values.values()) / len(values), **{f"val_loss/{n}": v for n, v in values.items() if n}}
