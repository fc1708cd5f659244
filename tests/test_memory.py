"""metrics.held_bytes counts real storages; memory.py's fake-tensor estimate reproduces them on any world size; the
memory table of docs/performance.md quotes the estimate (scripts/memory_table.py)."""

import pytest
import torch
import torch.nn.functional as F

from torchtitan_lite.config import load_config
from torchtitan_lite.models import documents
from torchtitan_lite.models.llama3.model import Transformer
from torchtitan_lite.runtime.metrics import held_bytes, storage_bytes
from torchtitan_lite.tools.memory import LLAMA3_VOCAB, estimate_memory, model_args
from torchtitan_lite.training.optim import build_optimizer

import memory_table  # scripts/memory_table.py (pytest.ini puts scripts/ on the path)
from tests.multiprocess.launch import DEBUGMODEL

TINY = ["--job.config_file", "tests/assets/tiny.toml"]
DEBUG = [*TINY, *DEBUGMODEL]  # 6 blocks: the tests below that count per block
STATE = ("param_bytes", "grad_bytes", "optimizer_bytes")


@pytest.fixture(scope="module")
def first_table_row():
    """The table's first row, 8B on FSDP 8, and its estimate: the one row the suite can afford (seconds; the
    others take minutes each, and scripts/memory_table.py --check compares them all)."""
    row = memory_table.ROWS[0]
    return row, memory_table.estimate(row)


def test_storage_bytes_counts_a_shared_storage_once():
    base = torch.zeros(100)
    assert storage_bytes([base[:10], base[10:], None]) == 400
    assert storage_bytes([torch.zeros(3), torch.zeros(3)]) == 24


@pytest.fixture(scope="module")
def one_process_held() -> dict[str, int]:
    """held_bytes of the tiny model really materialized and stepped in this process (the trainer's 1-rank path)."""
    cfg = load_config(TINY)
    torch.manual_seed(0)
    model = Transformer(model_args(cfg)[0])  # torch's default init: the values do not matter here
    optimizer = build_optimizer(model, cfg.optimizer, "cpu")
    tokens = torch.randint(0, model.args.vocab_size, (2, cfg.training.seq_len))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    return held_bytes(model, optimizer)


def test_one_rank_estimate_equals_a_materialized_model(one_process_held):
    estimate = estimate_memory(load_config(TINY), 1)
    assert {k: getattr(estimate, k) for k in STATE} == one_process_held
    n_params = sum(p.numel() for p in Transformer(model_args(load_config(TINY))[0]).parameters())
    assert one_process_held["param_bytes"] == 4 * n_params  # fp32, no padding on one rank


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_state_is_one_nth_up_to_padding(one_process_held, world_size):
    estimate = estimate_memory(load_config(TINY), world_size)
    assert estimate.mesh["dp_shard"] == world_size
    for key in STATE:
        whole, shard = one_process_held[key], getattr(estimate, key)
        # Rank 0 holds the largest shard: a dim that does not split evenly rounds up, by < 1% on this model.
        assert whole <= world_size * shard <= 1.01 * whole, key
    assert 0 < estimate.activation_bytes < estimate.peak_bytes


def test_8b_state_follows_from_its_parameter_count(first_table_row):
    row, estimate = first_table_row
    assert row.world_size == 8 and row.argv[1].endswith("llama3_8b.toml")
    assert estimate.vocab_size == LLAMA3_VOCAB == 128256
    n_params, n_tensors = 8_030_261_248, 32 * 9 + 3  # Llama 3 8B; per block 2 norms + 7 linears; embedding, norm, out
    # Every dim of 8B splits evenly over 8 ranks: no padding. fp32 everything; AdamW's step is one fp32 scalar.
    assert estimate.param_bytes == estimate.grad_bytes == 4 * n_params // 8
    assert estimate.optimizer_bytes == 2 * 4 * n_params // 8 + 4 * n_tensors
    assert estimate.peak_bytes > estimate.param_bytes + estimate.grad_bytes + estimate.optimizer_bytes


def test_cpu_offload_moves_the_state_to_the_host():
    device = estimate_memory(load_config(TINY), 2)
    offload = estimate_memory(load_config([*TINY, "--parallelism.fsdp_cpu_offload"]), 2)
    state = offload.param_bytes + offload.grad_bytes + offload.optimizer_bytes
    assert offload.host_bytes == state > 0 and device.host_bytes == 0
    assert offload.peak_bytes < device.peak_bytes


def test_the_memory_table_lists_the_scripts_rows_and_quotes_the_first_exactly(first_table_row):
    rows = memory_table.page_rows(memory_table.PAGE.read_text())
    assert list(rows) == [row[:3] for row in memory_table.ROWS]
    row, estimate = first_table_row
    assert rows[row[:3]] == memory_table.line(row, estimate), "stale: run python scripts/memory_table.py --check"


@pytest.mark.parametrize("world_size, layout", [(1, []), (2, ["--parallelism.context_parallel_degree", "2"])])
def test_document_mask_is_counted(world_size, layout):
    """block_causal's cost is in the estimate: on one rank (a GPU's FlexAttention) the bytes the block mask of a
    micro-batch really holds, added to what the trace holds, and every token's rotary row; under CP the explicit mask
    of the whole window, one per micro-batch (local batch 2 x 64 x 64 fp32), which the trace builds and keeps, and
    this rank's rotary rows: each once, with no copy per block or chunk (cut in every block's attention, they cost
    10,240 bytes more on these 6 blocks)."""
    causal = estimate_memory(load_config([*DEBUG, *layout]), world_size)
    masked = estimate_memory(load_config([*DEBUG, *layout, "--model.attn_mask_type", "block_causal"]), world_size)
    batch, seq = 2, 64
    rows = batch * seq // world_size * 8 * 8  # this rank's tokens' complex64 rows of head_dim 16 / 2
    assert causal.mask_bytes == 0
    if world_size == 1:  # what the block mask of such a micro-batch really holds
        mask = documents.block_mask(torch.zeros(batch, seq, dtype=torch.long), torch.float32)
        expected = storage_bytes(t for t in mask.as_tuple() if isinstance(t, torch.Tensor))
    else:
        expected = batch * seq * seq * 4
    assert masked.mask_bytes == expected
    assert masked.activation_bytes - causal.activation_bytes == expected + rows
    assert masked.peak_bytes - causal.peak_bytes >= expected


def test_float8_keeps_the_state_and_gathers_converted_weights_at_one_byte(monkeypatch):
    """A float8 run holds what an nn.Linear run holds (fp32 weights, gradients, AdamW state: float8 changes only the
    matmuls) and saves the same activations (torchao keeps the high-precision input for backward); with FSDP's float8
    all-gather each block arrives at 1 byte a converted weight element, its two norms at their own 4 bytes, and the
    root (embedding, final norm, output: never converted) at 4. Debug model on FSDP 2 (no padding: every dim even)."""
    gathered = []
    all_gather = torch.distributed.all_gather_single  # FSDP2's all-gather (its DefaultAllGather)

    def recording(output, *args, **kwargs):
        gathered.append(output.numel() * output.element_size())
        return all_gather(output, *args, **kwargs)

    plain = estimate_memory(load_config(DEBUG), 2)
    monkeypatch.setattr(torch.distributed, "all_gather_single", recording)
    f8 = estimate_memory(load_config([*DEBUG, "--float8.enable_float8_linear",
                                      "--float8.enable_fsdp_float8_all_gather"]), 2)
    for key in (*STATE, "activation_bytes"):
        assert getattr(f8, key) == getattr(plain, key), key
    converted, norms = 4 * 256 * 256 + 3 * 256 * 768, 2 * 256  # wq wk wv wo, w1 w2 w3; attention and FFN norms
    root = 4 * (2 * 258 * 256 + 256)
    # Two steps of forward (7 groups: the blocks, then the root) and backward (the blocks but the last, re-gathered).
    step = [root, *[converted + 4 * norms] * 6, *[converted + 4 * norms] * 5]
    assert gathered == 2 * step
    assert f8.transient_bytes < plain.transient_bytes and f8.peak_bytes < plain.peak_bytes
