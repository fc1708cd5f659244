"""Context parallelism's arithmetic in one process: which tokens a cp rank holds, attention over them equal to the
whole sequence's rows, and a layout that cannot run refused in one line (train.py --check). The multi-process runs,
gradients and checkpoints are in tests/multiprocess/test_context_parallel.py."""

from types import SimpleNamespace

import pytest
import torch

from torchtitan_lite.models import documents
from torchtitan_lite.models.common.attention import attend
from torchtitan_lite.models.common.rope import apply_rope, rope_table
from torchtitan_lite.models.llama3.model import FLAVORS
from torchtitan_lite.parallel import context_parallel
from torchtitan_lite.parallel.context_parallel import Attend, chunks, shard


@pytest.mark.parametrize("balancer", ["headtail", "none"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ranks_hold_every_position_once_and_headtail_balances_the_work(cp, balancer):
    seq = 48
    held = [chunks(seq, cp, rank, balancer) for rank in range(cp)]
    positions = sorted(p for ranges in held for start, stop in ranges for p in range(start, stop))
    assert positions == list(range(seq))
    # Causal work: a query at position p attends to p + 1 keys.
    work = [sum(p + 1 for start, stop in ranges for p in range(start, stop)) for ranges in held]
    if balancer == "headtail":
        assert len(set(work)) == 1 and all(len(ranges) == 2 for ranges in held)
    else:
        assert work == sorted(work) and (cp == 1 or work[-1] > work[0])
    assert held[0][0][0] == 0


class FakeMesh:
    """One rank of a cp group, for Attend outside a process group."""

    def __init__(self, cp: int, rank: int, device_type: str):
        self.cp, self.rank, self.device_type = cp, rank, device_type

    def size(self):
        return self.cp

    def get_local_rank(self):
        return self.rank

    def get_group(self):
        return SimpleNamespace(group_name="fake")


@pytest.mark.parametrize("v_dim", [8, 4], ids=["values_as_keys", "smaller_values"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "block_causal"])
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("balancer", ["headtail", "none"])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_each_rank_attends_as_its_rows_of_whole_sequence_attention(cp, balancer, device_type, masked, v_dim,
                                                                   monkeypatch):
    """Every rank's output is its tokens' rows of attention over the whole sequence: true positions for the rotary
    embeddings, the gathered keys put back in sequence order, each chunk's causal mask (the GPU's, SDPA's lower-right
    causal bias, run here on the CPU too). Grouped-query heads (8 query, 2 kv) as in Llama 3. block_causal: the
    documents' mask and each token's position in its document, documents crossing the chunks' borders. Values of
    another head size than the keys' (MLA's) come back apart as they went in."""
    seq, args = 48, FLAVORS["debugmodel"].with_(vocab_size=8, max_seq_len=48, dim=64, n_heads=8, n_kv_heads=2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, seq, heads, size, generator=gen) for heads, size in ((8, 8), (2, 8), (2, v_dim)))
    rope, mask = rope_table(args), None
    if masked:
        starts = torch.rand(2, seq, generator=gen) < 0.15  # a document starts at each True
        ids = starts.cumsum(1)
        rope, mask = rope[documents.positions(ids)], documents.explicit_mask(ids, q.dtype)
    whole = attend(apply_rope(q, rope), apply_rope(k, rope), v, mask)
    kv = torch.cat([apply_rope(k, rope), v], dim=-1)  # what each rank contributes to the gather, in true order
    gathered = torch.cat([shard(kv, chunks(seq, cp, rank, balancer)) for rank in range(cp)])  # in rank order
    monkeypatch.setattr(context_parallel.funcol, "all_gather_single_autograd", lambda x, gather_dim, group: gathered)
    for rank in range(cp):
        attn = Attend(FakeMesh(cp, rank, device_type), seq, balancer)
        held = attn.rows(rope)  # as the model rotates its tokens: at the rows Attend cuts for them
        q_held, k_held = (apply_rope(shard(x, attn.ranges), held) for x in (q, k))
        out = attn(q_held, k_held, shard(v, attn.ranges), mask)
        torch.testing.assert_close(out, shard(whole, attn.ranges), rtol=0, atol=1e-6)


CP2 = ["--parallelism.context_parallel_degree", "2"]
CASES = {  # world size, overrides, what the one line must name
    "seq_len_not_split_in_2cp_chunks": (3, ["--parallelism.context_parallel_degree", "3"],
                                        "training.seq_len 64 is not divisible by 2 x context_parallel_degree 3 = 6"),
    "seq_len_not_split_under_sequence_parallel": (
        4, [*CP2, "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "36"],
        "36 is not divisible by 2 x context_parallel_degree 2 x tensor_parallel_degree 2 (sequence parallel) = 8"),
    "seq_len_not_split_in_cp_chunks": (4, ["--parallelism.context_parallel_degree", "4", "--training.seq_len", "66",
                                           "--parallelism.context_parallel_load_balancer", "none"],
                                       "66 is not divisible by context_parallel_degree 4 = 4"),
    "degrees_not_multiplying": (6, [*CP2, "--parallelism.tensor_parallel_degree", "2"],
                                "x context_parallel_degree 2 x tensor_parallel_degree 2"),
    "reshard_group_not_dividing_dp_shard_x_cp": (2, [*CP2, "--parallelism.fsdp_reshard_after_forward", "4"],
                                                 "must divide the FSDP shard degree 2"),
    "unknown_balancer": (2, [*CP2, "--parallelism.context_parallel_load_balancer", "ring"],
                         "context_parallel_load_balancer must be one of headtail, none"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_context_parallel_layout_is_one_line(case, error_line):
    world, overrides, expected = CASES[case]
    assert expected in error_line(world, overrides)
