"""Multi-token prediction's objective (model.mtp_depth, training.mtp_weight; the modules: models/common/mtp.py), as
DeepSeek-V3 writes it: depth k's loss is the cross-entropy of token i + k + 1 at each position i that has one, summed
and divided by the step's token count T like the main loss (its equation 24 divides by T, not by the T - k targets),
and the objective adds weight / D x the sum of the D depths' losses.

The targets come from the labels, the window's tokens one place on: depth k embeds the labels k - 1 places on and
predicts those k places on, the last k positions of each window predicting nothing (ignored). They are shifted on
whole windows, before context parallelism cuts them (step.Inputs), so a rank's share is the one process's.

Like the z-loss (z_loss.py), the term rides on the main logits (models/common/moe.WithLoss): the logged loss stays the
main model's cross-entropy on every layout, and `mtp_loss` is logged apart, before its weight, summed like the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan_lite.models.common.moe import WithLoss

IGNORED = -100  # cross_entropy's ignore_index: the positions a depth has no target for


class MTP:
    """Builds each micro-batch's shifted tokens and targets, and attaches the depths' losses to the main logits."""
    name = "mtp_loss"  # its field in metrics.jsonl

    @classmethod
    def from_config(cls, model_args, weight: float) -> MTP | None:
        """The objective of a model with `model_args`' MTP modules (none: None), weighted by training.mtp_weight's
        `weight` (0: the modules run and their loss is logged, untrained)."""
        depth = getattr(model_args, "mtp_depth", 0)
        return cls(depth, weight) if depth > 0 else None

    def __init__(self, depth: int, weight: float):
        self.depth, self.weight = depth, weight
        self.values: list[torch.Tensor] = []  # this step's, one per loss computed (step.Step sums them)
        self.seed: torch.Tensor | float = 1.0  # the gradient backward gives the term: the loss scale (fp16's)

    def targets(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens (bs, seq, D): depth k's embedded tokens in column k - 1; targets (bs, seq, 1 + D): the labels,
        then depth k's) of whole windows' `labels` (bs, seq)."""
        seq = labels.shape[1]
        shifted = torch.stack([labels.roll(-k, 1) for k in range(self.depth + 1)], -1)
        # Depth k at position i embeds token i + k (a label k - 1 on), and targets one more: those past the window
        # wrap around, harmlessly as inputs (causal: no earlier position sees them), ignored as targets.
        past_end = torch.arange(seq, device=labels.device)[:, None] >= seq - torch.arange(self.depth + 1,
                                                                                          device=labels.device)
        return shifted[..., :-1], shifted.masked_fill(past_end, IGNORED)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the main model's logits with weight / D x the depths' summed losses trained through them, its labels) of
        the forward's `logits` ((1 + D) x bs rows: models/common/decoder.py) and `targets` (bs, seq, 1 + D); `tokens`
        the step's global token count."""
        rows = targets.shape[0]
        depths = [F.cross_entropy(logits[k * rows:(k + 1) * rows].flatten(0, 1).float(),
                                  targets[..., k].flatten(), ignore_index=IGNORED, reduction="sum")
                  for k in range(1, self.depth + 1)]
        loss = torch.stack(depths).sum() / tokens
        loss = loss.to_local() if isinstance(loss, DTensor) else loss  # loss parallel's: each rank's is the whole
        self.values.append(loss.detach())
        return WithLoss.apply(logits[:rows], self.weight / self.depth * loss, self.seed), targets[..., 0]
