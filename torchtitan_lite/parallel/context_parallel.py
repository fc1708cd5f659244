"""Context parallelism (CP): each sequence split across the ranks of the "cp" mesh dim, the way Llama 3 was trained.

Llama 3's long-context stage (paper, section 3.3.2) all-gathers keys and values: each rank holds part of every
sequence, projects its tokens' queries, keys and values, gathers the keys and values of the whole sequence (one
all-gather per block; under grouped-query attention each is kv_heads/n_heads the size of the queries) and attends
with its own queries. The all-gather's backward is a reduce-scatter of dK and dV. Ring attention (torchtitan's,
through torch's `context_parallel`) overlaps the exchange with compute but needs attention kernels torch registers
for CUDA alone; the all-gather runs anywhere on plain SDPA, and is exactly testable on a CPU.

Design. The model never learns about meshes: its attention rotates the queries and keys of its tokens and calls
`self.attend(q, k, v, mask)` (in Llama, model.attend: causal SDPA over the whole sequence), and `apply_cp` swaps in
`Attend`, which knows this rank's positions and the cp group, through the model's `attend_with`, with `Attend.rows`,
which cuts this rank's rotary rows once per forward for all blocks. The data loader hands each rank its share of every
sequence (`shard`, inputs and labels alike), so everything but attention (norms, FFN, the loss) is token-wise and
untouched: the loss stays a sum of token losses over the global token count, and FSDP, which shards the parameters
over dp_shard x cp since CP ranks hold the same weights, sums the cp ranks' gradients like any data-parallel ones.
Under TP, attention sees its local heads and the tokens of its cp rank: the two compose without knowing each other.

Load balance. Under a causal mask the last tokens attend to the most keys. "headtail" cuts the sequence into 2 x cp
chunks and gives rank i chunks i and 2 x cp - 1 - i, so every rank does the same work; "none" gives rank i the i-th
of cp contiguous chunks (the last rank then does 2 - 1/cp times the average). Each chunk's queries attend to the
gathered keys up to the chunk's end under SDPA's lower-right causal bias: on the GPU, the flash kernel's own causal
mask; elsewhere a float mask per chunk, built once (`lower_right_masks`).

Document masking (block_causal, models/documents.py): the step computes the document ids of the whole window before
it cuts the sequence (step.py), so every rank knows where each of the gathered keys' documents starts; the model
builds the window's explicit mask and every token's rotary row from them, and each chunk attends with the mask's rows
of its queries over the keys up to its end, which already hold the causal part. The load balance is the causal one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan_lite.config import ConfigError


def chunks(seq_len: int, cp: int, rank: int, balancer: str) -> list[tuple[int, int]]:
    """This rank's [start, stop) ranges of a sequence, in the order it holds them."""
    if balancer == "none":
        size = seq_len // cp
        return [(rank * size, (rank + 1) * size)]
    size = seq_len // (2 * cp)
    return [(i * size, (i + 1) * size) for i in (rank, 2 * cp - 1 - rank)]


def shard(x: torch.Tensor, ranges: list[tuple[int, int]], dim: int = 1) -> torch.Tensor:
    """The rows of `x` along `dim` that `ranges` name, in their order."""
    return torch.cat([x.narrow(dim, start, stop - start) for start, stop in ranges], dim)


def sharder(cp_mesh: DeviceMesh, seq_len: int, balancer: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What the data loader applies to inputs and labels: this rank's part of every sequence (None without CP)."""
    if cp_mesh.size() == 1:
        return None
    return partial(shard, ranges=chunks(seq_len, cp_mesh.size(), cp_mesh.get_local_rank(), balancer))


def check_cp(seq_len: int, cp: int, tp: int, balancer: str) -> None:
    """Every rank must hold whole, equal chunks, which sequence parallelism (TP) splits again into equal parts."""
    parts = (2 if balancer == "headtail" else 1) * cp * tp
    if seq_len % parts:
        what = f"{'2 x ' if balancer == 'headtail' else ''}context_parallel_degree {cp}" + (
            f" x tensor_parallel_degree {tp} (sequence parallel)" if tp > 1 else "")
        raise ConfigError(f"training.seq_len {seq_len} is not divisible by {what} = {parts}: use a multiple of "
                          f"{parts}, e.g. {max(parts, seq_len // parts * parts)}")


class Attend:
    """The model's attention for this cp rank's tokens: their keys and values gathered over the cp group, in true
    order. `whole_rows` (training.layout_invariant): one call for all this rank's queries against every key, under
    the causal rows of their positions, as cp_blocks.VirtualAttend computes each rank's on one process."""

    def __init__(self, cp_mesh: DeviceMesh, seq_len: int, balancer: str, whole_rows: bool = False):
        self.cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.group = cp_mesh.get_group().group_name  # a name, not an object: compiled blocks trace it as a constant
        self.ranges = chunks(seq_len, self.cp, rank, balancer)
        self.order = gather_order(seq_len, self.cp, balancer)
        self.calls = (whole_row_calls(self.ranges, seq_len, cp_mesh.device_type) if whole_rows
                      else chunk_calls(self.ranges, cp_mesh.device_type))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """`q`, `k`: rotated at this rank's tokens' true positions (the rows `rows` cut). `mask` (block_causal): the
        explicit mask of the whole window, of which each chunk attends with its rows."""
        # One collective for both, which may differ in head size (MLA's keys carry a rotary part its values lack).
        return attend_rows(q, self.gather(torch.cat([k, v], dim=-1)), k.shape[-1], self.calls, mask)

    def rows(self, rope: torch.Tensor, batch: int | None = None) -> torch.Tensor:
        """This rank's rows of `rope`: of the table (first rows: positions 0..seq-1), or of every token's own row
        (block_causal, (bs, seq, head_dim/2))."""
        return shard(rope, self.ranges, dim=0 if rope.dim() == 2 else 1)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(bs, local seq, ...) -> (bs, whole seq, ...) in true order; backward: a reduce-scatter (sum) of the
        gradient, each rank getting its own tokens' share."""
        parts = funcol.all_gather_single_autograd(x, gather_dim=0, group=self.group).chunk(self.cp)
        return in_order(parts, self.order)


def gather_order(seq_len: int, cp: int, balancer: str) -> list[tuple[int, int, int]]:
    """Where each chunk of the sequence sits among the gathered shares: (rank, offset in its share, length), in
    sequence order."""
    held = []
    for r in range(cp):
        offset = 0
        for start, stop in chunks(seq_len, cp, r, balancer):
            held.append((start, r, offset, stop - start))
            offset += stop - start
    return [where for _, *where in sorted(held)]


def in_order(parts: tuple[torch.Tensor, ...], order: list[tuple[int, int, int]]) -> torch.Tensor:
    """The ranks' shares `parts`, (bs, local seq, ...) each, as one (bs, whole seq, ...) in true order."""
    return torch.cat([parts[r].narrow(1, offset, size) for r, offset, size in order], dim=1)


# One SDPA call of a rank: (its queries' count, the keys it sees, its causal mask, the [first, stop) rows of a
# document mask it takes).
Call = tuple[int, int, object, "tuple[int, int] | None"]


def chunk_calls(ranges: list[tuple[int, int]], device_type: str) -> list[Call]:
    """A call per chunk, each against the keys up to the chunk's end: the least work."""
    masks = lower_right_masks(ranges, device_type)
    return [(stop - start, stop, causal, (start, stop)) for (start, stop), causal in zip(ranges, masks)]


def whole_row_calls(ranges: list[tuple[int, int]], seq_len: int, device_type: str = "cpu") -> list[Call]:
    """One call for every query of `ranges` against every key: each attention row computed whole, as on one
    process (no document mask: the mode it serves refuses block_causal)."""
    positions = torch.cat([torch.arange(start, stop) for start, stop in ranges])
    causal = torch.zeros(len(positions), seq_len).masked_fill_(torch.arange(seq_len) > positions[:, None],
                                                               float("-inf")).to(device_type)
    return [(len(positions), seq_len, causal, None)]


def attend_rows(q: torch.Tensor, kv: torch.Tensor, k_dim: int, calls: list[Call],
                mask: torch.Tensor | None) -> torch.Tensor:
    """A rank's queries `q` (bs, local seq, heads, dim) against the whole sequence's keys and values `kv` (their
    last dim: k_dim of keys, then the values'), by `calls`."""
    k, v = kv.transpose(1, 2).split([k_dim, kv.shape[-1] - k_dim], dim=-1)
    q = q.transpose(1, 2)
    outs, start = [], 0
    for size, keys, causal, span in calls:
        rows = causal if mask is None else mask[:, :, span[0]:span[1], :keys]
        outs.append(F.scaled_dot_product_attention(q[:, :, start:start + size], k[:, :, :keys], v[:, :, :keys],
                                                   attn_mask=rows, enable_gqa=q.shape[1] != k.shape[1]))
        start += size
    return torch.cat(outs, dim=2).transpose(1, 2)


def lower_right_masks(ranges: list[tuple[int, int]], device_type: str) -> list:
    """Each chunk's mask: its queries see the keys up to its end. On the GPU, SDPA's lower-right causal bias, which
    the flash kernel applies itself. Elsewhere SDPA would materialize that bias as a new float mask at every call,
    which every block keeps for its backward: one float mask per chunk is made here and shared. Both are built before
    any compiled code runs, which cannot construct them."""
    # Imported here, by CP runs alone: torch.nn.attention.bias imports torch._dynamo, whose import time (measured in
    # docs/performance.md) `train.py --check` (run_train.sh's preflight) and a config error would otherwise pay.
    from torch.nn.attention.bias import causal_lower_right

    if device_type == "cuda":
        return [causal_lower_right(stop - start, stop) for start, stop in ranges]
    return [torch.zeros(stop - start, stop).masked_fill_(~causal_lower_right(stop - start, stop)._materialize(),
                                                         float("-inf")) for start, stop in ranges]


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, seq_len: int, balancer: str, whole_rows: bool = False) -> None:
    attend = Attend(cp_mesh, seq_len, balancer, whole_rows)
    model.attend_with(attend, attend.rows)
