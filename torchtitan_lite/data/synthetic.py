"""Synthetic data: token windows with learnable structure for any seq_len and vocabulary, with no files to read
(the default dataset, so a fresh clone trains at once)."""

from __future__ import annotations

import torch

from torchtitan_lite.models.init import uniform


class SyntheticSource:
    """Endless deterministic windows with learnable structure, from integer hashing alone (version-independent).

    Each sequence walks a fixed random permutation of the ids (next = perm[current]) and jumps to a random id with
    probability 1/8, so the loss can fall from ln(regular_ids) to about 1.1 nats. The ids are the tokenizer's regular
    ones, [0, regular_ids): its special ids follow them (tokenizer.py) and never appear, so a synthetic window holds
    no BOS and is one document to block_causal's mask, beside text in a mixture too.
    """

    restart_prob = 1 / 8

    def __init__(self, seq_len: int, regular_ids: int, seed: int):
        self.seq_len, self.vocab, self.seed, self.key = seq_len, regular_ids, seed, f"{seed}/synthetic"
        perm = torch.argsort(uniform(torch.arange(regular_ids), f"{self.key}/perm"), stable=True)
        # perm applied 2**j times, so a run of k steps from a restart token costs log2(k) gathers, not a loop.
        self.perm_pow2 = [perm]
        while 2 ** len(self.perm_pow2) <= seq_len:
            self.perm_pow2.append(self.perm_pow2[-1][self.perm_pow2[-1]])

    def windows(self, index: torch.Tensor) -> torch.Tensor:
        n, length = index.numel(), self.seq_len + 1
        flat = index.view(-1, 1) * length + torch.arange(length)
        restart = uniform(flat, f"{self.key}/restart") < self.restart_prob
        restart[:, 0] = True
        token = (uniform(flat, f"{self.key}/token") * self.vocab).long()
        pos = torch.arange(length).expand(n, length)
        start = torch.where(restart, pos, torch.zeros_like(pos)).cummax(dim=1).values
        steps, out = pos - start, token.gather(1, start)
        for j, perm_j in enumerate(self.perm_pow2):
            out = torch.where((steps >> j) & 1 == 1, perm_j[out], out)
        return out
