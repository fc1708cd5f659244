"""The decoder's KV cache for generation (tools/generation.py): every layer's rotated keys and values of the positions
decoded so far, preallocated, and the attention of new queries over them. The model makes it
(Decoder.kv_cache), so an architecture whose attention caches something else (MLA's compressed latents) brings its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class KVCache:
    """Every layer's keys and values for positions [0, length), preallocated for `max_len` positions, stored as
    (batch, kv_heads, position, head_dim): the layout SDPA takes, so a step does not transpose the whole cache."""

    def __init__(self, model: nn.Module, batch: int, max_len: int):
        a, weight = model.args, model.tok_embeddings.weight
        # Values may have a head size of their own (MLA's): v_dim where the args have one.
        k_shape, v_shape = ((batch, a.kv_heads, max_len, dim) for dim in (a.head_dim, getattr(a, "v_dim", a.head_dim)))
        self.layers = [LayerCache(self, torch.zeros(k_shape, dtype=weight.dtype, device=weight.device),
                                  torch.zeros(v_shape, dtype=weight.dtype, device=weight.device))
                       for _ in range(a.n_layers)]
        self.length = 0
        self.mask = None  # of the chunk being decoded: which cached and new positions each new query sees

    def layer(self, index: int) -> LayerCache:
        return self.layers[index]


class LayerCache:
    """One layer's keys and values; attends like model.attend, at the positions after the cached ones."""

    def __init__(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor):
        self.cache, self.k, self.v = cache, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pos, end = self.cache.length, self.cache.length + q.shape[1]
        self.k[:, :, pos:end] = k.transpose(1, 2)
        self.v[:, :, pos:end] = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), self.k[:, :, :end], self.v[:, :, :end],
                                             attn_mask=self.cache.mask, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)
