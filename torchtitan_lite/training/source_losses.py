"""What a logging step all-reduces beside the loss: the terms trained beside it (the z-loss, multi-token prediction's:
step.Step.side), and a mixture's numbers
per source: each source's training loss, and the tokens and epochs the run has taken from it.

The loss of a source is the mean token loss of its windows in the logged step's global batch. Its sequences' summed
token losses (step.row_losses, measured beside the loss at logging steps only) are added up per source on each rank
and travel in the same all-reduce as the step's loss: no collective and no host sync more than a run without a
mixture, and none at all between logging steps. Tokens and epochs need no communication: the mixture's quotas say
how many windows of each source every step before took (data/mixture.py).
"""

from __future__ import annotations

import torch

from torchtitan_lite.data.loader import DataLoader
from torchtitan_lite.training.step import Batch, Step


class SourceLosses:
    """The step's forward and backward with, at logging steps, the side terms and a mixture's per-source summed token
    losses beside the loss; their fields for metrics.jsonl. Nothing more without either."""

    def __init__(self, loader: DataLoader, model_step: Step, seq_len: int, global_tokens: int):
        self.loader, self.step, self.seq_len, self.tokens = loader, model_step, seq_len, global_tokens
        self.mixture = loader.source if len(getattr(loader.source, "names", ())) > 1 else None

    def train_step(self, batches: list[Batch], logging: bool) -> torch.Tensor:
        """model_step.train_step; returns what a logging step all-reduces: the step's loss, its side terms, then
        at a mixture's logging steps each source's summed token losses on this rank."""
        rows = [] if self.mixture is not None and logging else None
        loss_sum = self.step.train_step(batches, self.tokens, rows)
        sums = [loss_sum.view(1)] + [side.view(1) for side in self.step.side_sums]
        if rows is None:
            return torch.cat(sums) if len(sums) > 1 else loss_sum.view(1)
        per_source = torch.zeros(len(self.mixture.names), device=loss_sum.device)
        sources = self.loader.sources
        if rows:  # a pipeline's first stages compute no loss: they add zeros
            # The last rows are the batch's: a pipeline's shape inference computes one loss more at its first step.
            batch_rows = torch.cat(rows)[-len(sources):]
            per_source.index_add_(0, torch.tensor(sources, device=batch_rows.device), batch_rows)
        return torch.cat([*sums, per_source])

    def fields(self, totals: list[float], step: int) -> dict[str, float]:
        """metrics.jsonl's fields after `step` (1-based) from the reduced totals: z_loss and mtp_loss (each before
        its weight) when on;
        per source, loss/NAME for each source in this step's batch, tokens/NAME and, for a source of known size,
        epochs/NAME."""
        first = 1 + len(self.step.side)  # where the per-source sums start
        out = {term.name: totals[1 + i] for i, term in enumerate(self.step.side)}
        if self.mixture is None:
            return out
        m = self.mixture
        quotas, taken = m.quotas[m.phase_at(step - 1)], m.consumed(step)
        for i, name in enumerate(m.names):
            if len(totals) > first and quotas[i]:
                out[f"loss/{name}"] = totals[first + i] / (quotas[i] * self.seq_len)
            out[f"tokens/{name}"] = taken[i] * self.seq_len
            if n := getattr(m.parts[i], "n", None):
                out[f"epochs/{name}"] = taken[i] / n
        return out
