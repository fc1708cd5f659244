"""PaLM's z-loss (training.z_loss): the mean over the step's tokens of log(Z)^2, Z the sum of a token's exponentiated
output logits, trained beside the cross-entropy with a small weight (PaLM: 1e-4) so that log(Z) stays near 0 and
the logits cannot drift up together, which the cross-entropy alone does not see.

It is trained and logged apart: the term rides on the logits (models/common/moe.WithLoss, as the MoE's auxiliary
losses ride on the router's weights), so the loss every run logs and every parity test compares stays the
cross-entropy, on every layout and under a pipeline schedule, which backpropagates the loss it is given. The logged
`z_loss` is before the weight, summed like the loss: each rank's tokens over the step's global token count.

Under loss parallel the logits are sharded on the vocabulary: a token's log(Z) is its shards' maxima and sums of
exponentials all-reduced (DTensor's Partial reductions, a value per token, never the logits gathered), the sharded
cross-entropy's own computation, within float reduction order of one process's.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from torchtitan_lite.models.common.moe import WithLoss


def log_z(logits: torch.Tensor) -> torch.Tensor:
    """Each token's log-sum-exp of its logits (tokens, vocab), a DTensor sharded on the vocabulary or a tensor."""
    if not isinstance(logits, DTensor):
        return logits.logsumexp(-1)
    peak = logits.detach().amax(-1, keepdim=True).redistribute(placements=[Replicate()] * logits.device_mesh.ndim)
    return (logits - peak).exp().sum(-1).log() + peak.squeeze(-1)


class ZLoss:
    """Attaches the z-loss of each training micro-batch to its logits, and keeps the values for the log."""
    name = "z_loss"  # its field in metrics.jsonl

    @classmethod
    def from_config(cls, weight: float) -> ZLoss | None:
        """training.z_loss's: None when off (0)."""
        return cls(weight) if weight > 0 else None

    def __init__(self, weight: float):
        self.weight = weight
        self.values: list[torch.Tensor] = []  # this step's, one per loss computed (Step.train_step sums them)
        self.seed: torch.Tensor | float = 1.0  # the gradient backward gives the term: the loss scale (fp16's)

    def __call__(self, logits: torch.Tensor, tokens: int) -> torch.Tensor:
        """`logits` (batch, seq, vocab) unchanged, with weight x (this micro-batch's sum of log(Z)^2) / `tokens` (the
        step's global token count) trained through them."""
        z = log_z(logits.flatten(0, 1).float()).square().sum() / tokens
        z = z.to_local() if isinstance(z, DTensor) else z  # replicated: each rank's copy is the whole value
        self.values.append(z.detach())
        return WithLoss.apply(logits, self.weight * z, self.seed)
