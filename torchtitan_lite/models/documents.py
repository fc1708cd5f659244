"""Document masking (`model.attn_mask_type = "block_causal"`, torchtitan's name): inside a packed window a token
attends only to the earlier tokens of its own document, and rotary positions restart at each document's start, so
each document is computed exactly as if it were run alone (tests/test_documents.py proves it per token).

Documents are packed as BOS + tokens + EOS (data/), so where they start is in the tokens themselves: a document
starts at each BOS, and a window that starts inside a document holds a fragment whose positions start at the window
start. The loader therefore stays as it is; the step derives document ids from a micro-batch's inputs
(`document_ids`) and hands them to the model, which derives the rest (`positions`, the mask) once per micro-batch.
The ids are of the whole window: context parallelism computes them before it cuts the sequence, and every pipeline
stage gets them beside its hidden states (step.py, pipeline.py); the model itself never learns about meshes.

Two kernels, chosen once at start-up (`Transformer.document_mask`):
- `explicit_mask`: an additive float mask (0 or -inf) for SDPA, (batch, 1, seq, seq) in the activations' dtype, so
  neither FSDP's input cast nor SDPA copies it. The CPU's path (FlexAttention has no CPU backward in torch 2.13) and
  context parallelism's, whose ranks attend with the mask's rows of their chunks.
- `block_mask`: FlexAttention's BlockMask, as torchtitan uses on GPUs: tiles of 128 queries x 128 keys that are all
  masked are skipped, those all unmasked computed without the mask. Built from the ids at tile granularity, so no
  seq x seq tensor exists, not even while it is built (tests/test_documents.py records every op's output); its
  tensors equal those of torch's create_block_mask, and its forward the explicit mask's, on the CPU.
"""

from __future__ import annotations

import logging

import torch


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """(batch, seq) ids of the document each token belongs to: 0 for a fragment before the window's first BOS, then
    one more at each BOS. Only equality between ids of one row means anything."""
    return (tokens == bos_id).cumsum(dim=1)


def positions(documents: torch.Tensor) -> torch.Tensor:
    """(batch, seq) each token's position in its document (in its fragment, for one cut by the window's start)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values


def allowed(documents: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool: query i may see key j (same document, j <= i)."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, None, :, None] == documents[:, None, None, :]) & causal


def explicit_mask(documents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive SDPA mask of `documents`, in `dtype`. Built once per micro-batch and shared by every block: a
    bool mask would be turned into a new float one by SDPA at every call, and kept by each block for backward."""
    mask = torch.zeros(documents.shape[0], 1, documents.shape[1], documents.shape[1], dtype=dtype,
                       device=documents.device)
    return mask.masked_fill_(~allowed(documents), float("-inf"))


BLOCK = 128  # FlexAttention's block (torch's default): the kernel skips or fully computes each BLOCK x BLOCK tile


def document_causal(documents: torch.Tensor):
    """FlexAttention's mask_mod of `documents`: query q sees key kv of its own document at or before it. The kernel
    evaluates it only inside the tiles that block_mask marks as partly masked."""
    def mask_mod(b, h, q, kv):
        return (documents[b, q] == documents[b, kv]) & (q >= kv)
    return mask_mod


def block_mask(documents: torch.Tensor, dtype: torch.dtype):
    """FlexAttention's BlockMask of `documents` (`dtype` unused: a block mask holds block indices, not scores), equal
    to torch's `create_block_mask(document_causal(documents), batch, None, seq, seq)` tensor for tensor.

    Built from each block's first and last document id, in batch x n x n memory for n blocks, never from the
    (batch, seq, seq) mask that torch's uncompiled create_block_mask materializes (docs/performance.md has both
    peaks): ids never decrease along a window (document_ids), so a key block wholly before a query block shares a
    document with it only if its last id is the query block's first, and is all one document with it only if its
    first id is the query block's last. Diagonal tiles are partly masked (causality inside them), those after them
    empty. Past a sequence that does not fill its last block, torch pads the mask with masked entries: tiles of the
    last query row are then never full."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, seq = documents.shape
    starts = torch.arange(0, seq, BLOCK, device=documents.device)
    first, last = documents[:, starts], documents[:, (starts + BLOCK).clamp(max=seq) - 1]  # (batch, n blocks)
    blocks = torch.arange(len(starts), device=documents.device)
    before = blocks[:, None] > blocks[None, :]  # key block j wholly before query block i
    full = before & (first[:, None, :] == last[:, :, None])  # [b, i, j]: both blocks in one document
    if seq % BLOCK:
        full[:, -1] = False
    partial = (before & (last[:, None, :] == first[:, :, None]) & ~full) | (blocks[:, None] == blocks[None, :])
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=document_causal(documents), seq_lengths=(seq, seq))


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, n, n) bool -> a BlockMask's (count, indices) per query block, with a head dimension of 1: the marked
    key blocks in ascending order first, then the others, as torch orders them."""
    blocks = blocks[:, None].to(torch.int32)
    order = torch.argsort(blocks, dim=-1, descending=True, stable=True)
    return blocks.sum(dim=-1, dtype=torch.int32), order.to(torch.int32)


def block_mask_bytes(batch: int, seq: int, block: int = BLOCK) -> int:
    """The bytes `block_mask` holds for `batch` windows of `seq` tokens: int32 counts and indices of the partly and
    the fully unmasked blocks, by rows (forward) and by columns (backward): 4 x 4 x batch x n x (n + 1), n = seq /
    block rounded up (tests/test_documents.py counts them). Megabytes where the explicit mask takes gigabytes (batch x
    seq^2 in the activations' dtype)."""
    n = -(-seq // block)
    return 16 * batch * n * (n + 1)


_compiled_flex = None


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """FlexAttention of (batch, heads, seq, head_dim) under a BlockMask. Compiled, as torchtitan runs it: eager flex
    attention is a reference implementation that materializes the scores (inside a compiled block this call is
    traced into the block's graph)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu":  # the CPU suite's check of the GPU path: forward only, eager
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


KERNELS = {"sdpa": explicit_mask, "flex": block_mask}
logger = logging.getLogger("torchtitan_lite")


def kernel(device_type: str, cp: int) -> str:
    """The masked kernel a run uses: FlexAttention on a GPU, SDPA with the explicit mask on the CPU and under context
    parallelism (whose chunks attend with rows of the mask)."""
    return "flex" if device_type == "cuda" and cp == 1 else "sdpa"


def use_kernel(parts: list, device_type: str, cp: int, masked: bool) -> None:
    """Gives each of a run's models (its pipeline stages) the run's way to mask, chosen once (kernel()); a masked GPU
    run that cannot use FlexAttention is told what the explicit mask costs."""
    name = kernel(device_type, cp)
    for part in parts:
        part.document_mask = KERNELS[name]
    if masked and device_type == "cuda" and name != "flex":
        logger.warning("block_causal under context parallelism attends with an explicit mask of the whole window on "
                       "every rank (seq_len^2 per sequence), not FlexAttention's block mask")
