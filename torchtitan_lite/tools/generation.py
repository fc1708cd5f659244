"""Text generation from a trained model of any registered architecture, decoded with the KV cache the model makes
(`model.kv_cache(batch, max_len)`: models/common/kv_cache.py for the decoder): the prompt runs through the model once
(prefill), then each new token costs one position's forward instead of the whole sequence's.

The forward is the model's own: `model(tokens, cache=cache)` runs every block as training does, and each block's
attention hands its rotated queries and keys, and its values, to its layer of the cache instead of `model.attend`.
The cache writes the new keys and values after the cached ones and attends the new queries to every position it
holds. So decoding differs from training in attention alone, where a cache changes what attention sees;
tests/test_generate.py compares the cached logits with the model's uncached forward at every step.

Positions are the model's: a forward with a cache rotates its chunk at the positions after the cached ones
(`cache.length`), so the keys the cache holds are already rotated.

Context: at most model.args.max_seq_len tokens, the config's training.seq_len, as train.py builds the model. The
rope table has no rows past it and the model never saw such positions, so a prompt plus max_new_tokens that does not
fit is refused up front, with the numbers, rather than cropped.

Loading: one process and no process group. DCP reads each tensor's pieces from every rank's file, so a checkpoint
saved on any mesh (FSDP, TP, HSDP) loads here; only the `model.*` tensors are read, not the optimizer state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.checkpoint.finder import find_checkpoint
from torchtitan_lite.checkpoint.reader import check_fits, load_local, read_metadata
from torchtitan_lite.config import JobConfig
from torchtitan_lite.data.hf_tokenizer import run_tokenizer, run_vocab_size
from torchtitan_lite.data.tokenizer import Tokenizer
from torchtitan_lite.models import registry


class ContextError(ValueError):
    """The prompt and the tokens asked for do not fit in the model's context."""


@torch.no_grad()
def forward_cached(model: nn.Module, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Logits (batch, seq, vocab) of `tokens`, the positions right after the cached ones; appends their keys and
    values to the cache. The whole prompt at once (prefill), then one token at a time."""
    pos, seq = cache.length, tokens.shape[1]
    if pos + seq > model.rope.shape[0]:
        raise ContextError(f"position {pos + seq - 1} is past the model's context of {model.rope.shape[0]} tokens")
    # The query at position pos+i sees every cached position and the chunk's first i+1 tokens. One explicit mask
    # serves prefill (pos = 0: the causal mask), single-token steps (all True) and chunks in between.
    cache.mask = torch.ones(seq, pos + seq, dtype=torch.bool, device=tokens.device).tril(pos)
    logits = model(tokens, cache=cache)
    cache.length += seq
    return logits


def sample(logits: torch.Tensor, temperature: float, top_k: int | None,
           generator: torch.Generator | None) -> torch.Tensor:
    """(batch, 1) next-token ids from (batch, vocab) logits: the argmax when temperature is 0, else a draw from
    softmax(logits / temperature) restricted to the top_k most likely tokens (None or 0: all of them)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, eos_id: int | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True) -> list[int]:
    """The tokens that follow `prompt` (which starts with BOS, like the training documents), up to max_new_tokens;
    generation stops at `eos_id`, which is not returned. use_cache=False reruns the whole sequence at each step: the
    reference the tests hold the cache to."""
    context = model.args.max_seq_len
    if len(prompt) + max_new_tokens > context:
        raise ContextError(f"the prompt is {len(prompt)} tokens (with BOS) and {max_new_tokens} new tokens were "
                           f"asked for: {len(prompt) + max_new_tokens} exceed the model's context of {context} "
                           f"tokens (training.seq_len); ask for at most {max(context - len(prompt), 0)} new tokens "
                           "or shorten the prompt")
    tokens = torch.tensor([prompt], device=model.tok_embeddings.weight.device)
    cache = model.kv_cache(1, len(prompt) + max_new_tokens) if use_cache else None
    new, chunk = [], tokens
    for _ in range(max_new_tokens):
        logits = (forward_cached(model, chunk, cache) if cache else model(tokens))[:, -1]
        chunk = sample(logits, temperature, top_k, generator)
        if chunk.item() == eos_id:
            break
        new.append(chunk.item())
        if cache is None:
            tokens = torch.cat([tokens, chunk], dim=1)
    return new


# ---- Loading a trained model on one process.

def load_weights(model: nn.Module, path: str) -> None:
    """Copies the checkpoint's `model.*` tensors into the model's parameters, in place and cast to their dtype;
    raises ConfigError, naming the tensor, when the checkpoint was saved from another model."""
    state = {"model": model.state_dict()}  # views of the parameters: DCP writes straight into them
    metadata = read_metadata(path)
    check_fits(state, path, metadata)  # every parameter is in the checkpoint, same shapes, and nothing more
    load_local(state, path, metadata)


def load_model(cfg: JobConfig, checkpoint: str, device: torch.device,
               dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Tokenizer]:
    """The model of `cfg` built as train.py builds it (model.name's spec, flavor, the tokenizer's vocabulary,
    training.seq_len), on meta then materialized, with the weights of `checkpoint`: a step-N folder, or a checkpoint
    or dump folder (its newest complete step; checkpoint_finder.find_checkpoint)."""
    tokenizer = run_tokenizer(cfg)  # the run's: model.tokenizer_path's, or its Hugging Face folder's
    spec = registry.get(cfg.model.name)
    args = spec.run_args(cfg, run_vocab_size(cfg, tokenizer))
    path, _ = find_checkpoint(checkpoint, cfg.checkpoint.folder)
    with torch.device("meta"):
        model = spec.model_class(args)
    model.to_empty(device=device)
    # Not init_weights(): it would draw every parameter for the load to overwrite (seconds on a big model).
    model.init_buffers()
    # Parameters only: Module.to(dtype) would also turn the complex rope table real.
    for p in model.parameters():
        p.data = p.data.to(dtype)
    load_weights(model, path)
    return model.eval(), tokenizer
