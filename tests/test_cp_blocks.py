"""CP 2's order on one process (parallel/cp_blocks.py, training.layout_invariant_cp 2): the loader's stack of the two
ranks' halves, and attention on the stack giving each cp rank's outputs and query gradients bit for bit. The whole
model's equality, CP 2 against one process, is tests/multiprocess/test_layout_invariant.py's."""

import torch

from torchtitan_lite.models.common.attention import attend
from torchtitan_lite.models.common.rope import apply_rope, rope_table
from torchtitan_lite.models.llama3.model import FLAVORS
from torchtitan_lite.parallel import context_parallel
from torchtitan_lite.parallel.context_parallel import Attend, chunks, shard
from torchtitan_lite.parallel.cp_blocks import VirtualAttend, stacker
from tests.test_context_parallel import FakeMesh

SEQ = 16


def test_the_stack_is_each_leafs_rank_0_halves_then_its_rank_1_halves():
    x = torch.arange(4 * SEQ).view(4, SEQ)  # 4 sequences, leaves of 2
    stacked = stacker(SEQ, leaf=2)(x)
    ranks = [chunks(SEQ, 2, r, "headtail") for r in range(2)]
    expected = [shard(x[i:i + 1], ranks[r]) for leaf in (0, 2) for r in (0, 1) for i in (leaf, leaf + 1)]
    assert torch.equal(stacked, torch.cat(expected))
    assert stacked[0].tolist() == [*range(0, 4), *range(12, 16)]  # chunks 0 and 3 of sequence 0: rank 0's


def test_the_stacked_ranks_attend_as_each_cp_rank_bit_for_bit(monkeypatch):
    """Each rank's queries against every key in one call (Attend's whole_rows) on a cp rank, and the two ranks'
    stacked on one process: the same outputs and query gradients, and both the whole sequence's rows."""
    args = FLAVORS["debugmodel"].with_(vocab_size=8, max_seq_len=SEQ, dim=64, n_heads=8, n_kv_heads=2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, SEQ, heads, 8, generator=gen) for heads in (8, 2, 2))
    rope = rope_table(args)
    whole = attend(apply_rope(q, rope), apply_rope(k, rope), v)
    stack = stacker(SEQ, leaf=3)
    virtual = VirtualAttend(SEQ)
    q_stacked = stack(q).requires_grad_()
    out = virtual(apply_rope(q_stacked, virtual.rows(rope, 6)), apply_rope(stack(k), virtual.rows(rope, 6)), stack(v))
    out.backward(torch.ones_like(out))
    gathered = stack(torch.cat([apply_rope(k, rope), v], dim=-1))  # each rank's keys and values, in rank order
    monkeypatch.setattr(context_parallel.funcol, "all_gather_single_autograd", lambda x, gather_dim, group: gathered)
    for rank in range(2):
        attn = Attend(FakeMesh(2, rank, "cpu"), SEQ, "headtail", whole_rows=True)
        q_rank = shard(q, attn.ranges).requires_grad_()
        k_rank = shard(k, attn.ranges)
        out_rank = attn(apply_rope(q_rank, attn.rows(rope)), apply_rope(k_rank, attn.rows(rope)), shard(v, attn.ranges))
        out_rank.backward(torch.ones_like(out_rank))
        assert torch.equal(out.chunk(2)[rank], out_rank)
        assert torch.equal(q_stacked.grad.chunk(2)[rank], q_rank.grad)
        torch.testing.assert_close(out_rank, shard(whole, attn.ranges), rtol=0, atol=1e-6)
