"""A decoder block: attention and a feed-forward (dense or a mixture of experts) around pre-norms, the unit every
parallelism wraps (parallel/parallelize.py). decoder.py stacks them; mtp.py adds to one what a multi-token
prediction module needs."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan_lite.models.common.layers import FeedForward, RMSNorm
from torchtitan_lite.models.common.moe import MoE


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args):  # args: decoder.DecoderArgs
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = args.attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # A mixture-of-experts block holds `moe` where a dense one holds `feed_forward` (distinct parameter names),
        # and None for the other, as a pipeline stage does for what it does not hold (the TP plan names both).
        self.moe_enabled = args.moe is not None and args.moe.is_moe(layer_id)
        self.moe = self.feed_forward = None
        if self.moe_enabled:
            hidden = args.moe.hidden or args.ffn_hidden
            shared = FeedForward(args.dim, args.moe.shared_experts * hidden) if args.moe.shared_experts else None
            self.moe = MoE(args.dim, hidden, args.moe, shared)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_std = 0.02 / (2 * depth) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None, cache=None) -> torch.Tensor:
        # The cache as a keyword: TP's PrepareModuleInput lays out the positional inputs alone.
        h = x + self.attention(self.attention_norm(x), rope, mask, cache=cache)
        return h + (self.moe if self.moe_enabled else self.feed_forward)(self.ffn_norm(h))

    def init_weights(self, init) -> None:
        self.attention_norm.init_weights(init)
        self.ffn_norm.init_weights(init)
        self.attention.init_weights(init, self.out_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(init, self.out_std)
