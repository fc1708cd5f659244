"""Multi-token prediction (MTP, DeepSeek-V3's section 2.2): D modules after the main model, the k-th predicting the
token k + 1 places past the next one, each keeping the whole causal chain of the depth before it.

Module k combines, at each position i, the representation of the depth before and the embedding of token i + k, each
RMS-normalized, concatenated (the embedding first, as DeepSeek's published eh_proj takes them) and projected back to
the model's width; one transformer block of the model's kind follows, then its own final norm (DeepSeek's
shared_head.norm) and the model's output projection, which every depth shares with the main model, as it shares the
embedding table. A depth's representation is its final norm's output (the main model's for k = 1), as the modules
DeepSeek publishes are run by transformers' MtpModel and vLLM.

The module is a TransformerBlock with these pieces added, so what wraps a block (activation checkpointing, compile,
FSDP, the TP plan's block entries) wraps it too; its final norm is inside, where FSDP has its parameters gathered.

Training alone runs it (the decoder's `mtp_tokens`); the shifted targets, each depth's loss and their weight are the
training step's (training/mtp.py).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_lite.models.common.block import TransformerBlock
from torchtitan_lite.models.common.layers import RMSNorm


class MTPBlock(TransformerBlock):
    """The MTP module of depth layer_id - n_layers + 1: its block is built (and initialized) as block `layer_id`."""

    def __init__(self, layer_id: int, args):
        super().__init__(layer_id, args)
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, h: torch.Tensor, rope: torch.Tensor, mask=None,
                embedded: torch.Tensor | None = None) -> torch.Tensor:
        """This depth's representation (the output projection's input, and the next depth's `h`) from `h`, the depth
        before's, and `embedded`, the embeddings of the tokens this depth's places ahead."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], -1))
        return self.norm(super().forward(x, rope, mask))

    def init_weights(self, init) -> None:
        super().init_weights(init)
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.init_weights(init)
        init(self.eh_proj.weight, 0.02)
