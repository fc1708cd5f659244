"""Data: sources of token windows in one global order, and the loader that hands each rank its slice.

Every source defines a global sequence of windows of seq_len + 1 tokens (inputs and labels shifted by one). At
step s the global batch is windows [s*G, (s+1)*G) of that order, whatever the data-parallel degree; dp rank r takes
a contiguous slice of it. The loader's whole state is its position in the order, so a resume continues with the
exact next sample, also on a different number of data-parallel ranks.
"""

from __future__ import annotations

import torch

from torchtitan_lite.init import uniform


class SyntheticSource:
    """Endless deterministic windows with learnable structure, from integer hashing alone (version-independent).

    Each sequence walks a fixed random permutation of the vocabulary (next = perm[current]) and jumps to a random
    token with probability 1/8, so the loss can fall from ln(vocab) to about 1.1 nats.
    """

    restart_prob = 1 / 8

    def __init__(self, seq_len: int, vocab_size: int, seed: int):
        self.seq_len, self.vocab, self.key = seq_len, vocab_size, f"{seed}/synthetic"
        perm = torch.argsort(uniform(torch.arange(vocab_size), f"{self.key}/perm"), stable=True)
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


class DataLoader:
    """Yields, per step, this rank's micro-batches of (inputs, labels); stateful for checkpoints."""

    def __init__(self, source, global_batch: int, local_batch: int, dp_rank: int, dp_size: int):
        self.source, self.global_batch, self.local_batch = source, global_batch, local_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.position = 0  # windows of the global order consumed so far

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        per_rank = self.global_batch // self.dp_size
        first = self.position + self.dp_rank * per_rank
        windows = self.source.windows(torch.arange(first, first + per_rank))
        self.position += self.global_batch
        return [(w[:, :-1], w[:, 1:]) for w in windows.split(self.local_batch)]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def build_source(name: str, path: str, seq_len: int, tokenizer, seed: int):
    if name == "synthetic":
        return SyntheticSource(seq_len, tokenizer.n_words, seed)
    from torchtitan_lite.config import ConfigError

    raise ConfigError(f"training.dataset {name!r} is unknown: use 'synthetic'")
