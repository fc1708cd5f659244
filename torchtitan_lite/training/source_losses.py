"""A mixture's numbers per source at the logging steps: each source's training loss, and the tokens and epochs the run
has taken from it.

The loss of a source is the mean token loss of its windows in the logged step's global batch. Its sequences' summed
token losses (step.row_losses, measured beside the loss at logging steps only) are added up per source on each rank
and travel in the same all-reduce as the step's loss: no collective and no host sync more than a run without a
mixture, and none at all between logging steps. Tokens and epochs need no communication: the mixture's quotas say
how many windows of each source every step before took (data/mixture.py).
"""

from __future__ import annotations

import torch

from torchtitan_lite.data.loader import DataLoader
from torchtitan_lite.training.step import Step


class SourceLosses:
    """Per-source fields for metrics.jsonl; nothing at all unless the training data is a mixture of several sources."""

    def __init__(self, loader: DataLoader, model_step: Step, seq_len: int):
        self.loader, self.step, self.seq_len = loader, model_step, seq_len
        self.mixture = loader.source if len(getattr(loader.source, "names", ())) > 1 else None

    def begin(self, logging: bool) -> None:
        """Before a step: measure its rows when it will be logged."""
        if self.mixture is not None:
            self.step.rows = [] if logging else None

    def totals(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """What the logging step all-reduces: the step's loss, then each source's summed token losses on this rank."""
        if self.mixture is None or self.step.rows is None:
            return loss_sum.view(1)
        per_source = torch.zeros(len(self.mixture.names), device=loss_sum.device)
        sources = self.loader.sources
        if self.step.rows:  # a pipeline's first stages compute no loss: they add zeros
            # The last rows are the batch's: a pipeline's shape inference computes one loss more at its first step.
            rows = torch.cat(self.step.rows)[-len(sources):]
            per_source.index_add_(0, torch.tensor(sources, device=rows.device), rows)
        self.step.rows = None
        return torch.cat([loss_sum.view(1), per_source])

    def fields(self, totals: list[float], step: int) -> dict[str, float]:
        """metrics.jsonl's per-source fields after `step` (1-based) from the reduced totals: loss/NAME for each source
        in this step's batch, tokens/NAME and, for a source of known size, epochs/NAME."""
        if self.mixture is None:
            return {}
        m, out = self.mixture, {}
        quotas, taken = m.quotas[m.phase_at(step - 1)], m.consumed(step)
        for i, name in enumerate(m.names):
            if len(totals) > 1 and quotas[i]:
                out[f"loss/{name}"] = totals[1 + i] / (quotas[i] * self.seq_len)
            out[f"tokens/{name}"] = taken[i] * self.seq_len
            if n := getattr(m.parts[i], "n", None):
                out[f"epochs/{name}"] = taken[i] / n
        return out
