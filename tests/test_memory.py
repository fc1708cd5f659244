"""metrics.held_bytes counts real storages; memory.py's fake-tensor estimate reproduces them on any world size; the
memory table of docs/performance.md quotes the estimate (scripts/memory_table.py); scripts/estimate_memory.py's help
and table."""

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

from torchtitan_lite.config import ConfigError, help_text, load_config
from torchtitan_lite.models import documents, registry
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.runtime.metrics import held_bytes, storage_bytes
from torchtitan_lite.tools import memory, memory_extrapolate
from torchtitan_lite.tools.memory import Estimate, estimate_memory, model_args
from torchtitan_lite.tools.memory_extrapolate import Plan, extrapolate
from torchtitan_lite.training.optimizers import build_optimizer

import estimate_memory as script  # scripts/estimate_memory.py (pytest.ini puts scripts/ on the path)
import memory_table  # scripts/memory_table.py
from tests.multiprocess.launch import DEBUGMODEL
from tests.test_hf_load import hf_folder
from torchtitan_lite.data.tokenizer import LLAMA3_N_RANKS, LLAMA3_SPECIALS, STDLIB_BPE, Tokenizer

LLAMA3_VOCAB = LLAMA3_N_RANKS + len(LLAMA3_SPECIALS)  # 128256: Meta's tokenizer, the 8B/70B/405B configs'
TINY = ["--job.config_file", "tests/assets/tiny.toml"]
DEBUG = [*TINY, *DEBUGMODEL]  # 6 blocks: the tests below that count per block
STATE = ("param_bytes", "grad_bytes", "optimizer_bytes")


@pytest.fixture(scope="module")
def first_table_row():
    """The table's first row, 8B on FSDP 8, and its estimate, extrapolated from a few of its blocks (seconds);
    scripts/memory_table.py --check compares every row."""
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
    optimizer = build_optimizer(model, cfg, "cpu")
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
    assert estimate.traced == (3, 4, 5)  # extrapolated: selective AC by op, one block at either edge
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


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_scripts_help_gives_its_own_option_then_the_trainers(flag, capsys):
    assert script.main([*TINY, flag]) == 0
    out = capsys.readouterr().out
    own = out[:out.index(help_text())]
    assert own.startswith("usage: python scripts/estimate_memory.py [--world_size N]")
    assert "--world_size N" in own and "NGPU" in own and "(8B 8, 70B 64, 405B 128; any other flavor 8)" in own
    assert own.endswith("train.py option (--check aside); train.py's --help:\n\n")
    assert out == own + help_text() + "\n"


@pytest.mark.parametrize("toml, flavor, vocab", [
    ("mixtral_8x7b.toml", None, 32_000), ("mixtral_8x22b.toml", None, 32_000),
    ("llama3_8b.toml", "mixtral_8x7b", 32_000), ("llama3_70b.toml", None, LLAMA3_VOCAB)])
def test_a_missing_tokenizer_gives_the_flavors_published_vocabulary(tmp_path, toml, flavor, vocab):
    """The big configs point at a tokenizer an estimate should not need: without its file, the vocabulary the
    flavor's published model has (Mixtral's 32,000, not Llama 3's 128,256), and the estimate says so."""
    absent = tmp_path / "tokenizer.model"
    cfg = load_config(["--job.config_file", f"train_configs/{toml}", "--model.tokenizer_path", str(absent),
                       *(["--model.flavor", flavor] if flavor else [])])
    args, note = model_args(cfg)
    assert args.vocab_size == vocab
    assert note == f"{absent} not found: {cfg.model.flavor}'s published vocabulary assumed"


def test_the_tokenizer_gives_the_vocabulary_and_a_flavor_without_a_published_one_needs_it(tmp_path):
    args, note = model_args(load_config(["--job.config_file", "train_configs/debug_model.toml"]))
    assert (args.vocab_size, note) == (2050, "vocabulary of torchtitan_lite/assets/stdlib_bpe_2k.tiktoken")
    with pytest.raises(ConfigError, match="flavor debugmodel has no published vocabulary to assume"):
        model_args(load_config(["--job.config_file", "train_configs/debug_model.toml",
                                "--model.tokenizer_path", str(tmp_path / "tokenizer.model")]))


def test_a_run_from_a_hugging_face_folder_is_estimated_with_the_folders_vocabulary(tmp_path):
    """As train.py builds it: the folder's tokenizer (the project's BPE, 2050 ids, where none is named: not the
    byte-level 258) sizes the table, Qwen3's tied one here."""
    folder = hf_folder(tmp_path / "hf", Tokenizer.from_file(STDLIB_BPE), flavor="debugmodel", model="qwen3")
    args, note = model_args(load_config([*TINY, "--model.name", "qwen3", "--model.flavor", "debugmodel",
                                         "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path",
                                         str(folder)]))
    assert (args.vocab_size, note) == (2050, f"vocabulary of {folder}")


def test_the_scripts_table_names_expert_parallelism_and_where_the_vocabulary_comes_from():
    base = [*TINY, "--model.flavor", "tiny_moe"]
    ep2 = load_config([*base, "--parallelism.expert_parallel_degree", "2"])
    estimate = estimate_memory(ep2, 2)
    header, vocab = script.table(estimate, ep2).splitlines()[:2]
    assert header.endswith("mesh pp 1 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 1 (2 ranks, experts over ep 2); "
                           "per rank, MiB")
    assert vocab == '  (byte-level vocabulary: model.tokenizer_path = "")'
    assert "(2 ranks); per rank" in script.table(estimate, load_config(base))  # EP 1: no experts split


SELECTIVE = ("--activation_checkpoint.mode", "selective")  # every 2nd block, the option's default


def test_the_estimate_from_a_few_blocks_is_the_full_traces_to_the_byte(monkeypatch):
    """Traced with a few blocks and extrapolated, or traced whole: the same figures, to the byte. The layout is one
    with most of what makes blocks differ or the figures move: FSDP's edges (the last block stays gathered) over
    CP's shards, selective AC's period of 2 blocks (so traces of 4, 6 and 8 of the 10), the state on the host, CP's
    explicit document mask. Each layout costs its blocks' traces, so the others were checked once (TP, float8, full
    AC, prefetch: the commit's message), and the big configs' by scripts/memory_table.py --check."""
    monkeypatch.setitem(FLAVORS, "debug10", FLAVORS["debugmodel"].with_(n_layers=10))
    cfg = load_config([*TINY, "--model.flavor", "debug10", *SELECTIVE, "--parallelism.context_parallel_degree", "2",
                       "--parallelism.fsdp_cpu_offload", "--model.attn_mask_type", "block_causal"])
    few = estimate_memory(cfg, 2, extrapolate=True)
    full = estimate_memory(cfg, 2, extrapolate=False)
    assert (few.traced, full.traced) == ((4, 6, 8), (10,))
    assert dataclasses.replace(few, traced=()) == dataclasses.replace(full, traced=())
    assert few.host_bytes == few.param_bytes + few.grad_bytes + few.optimizer_bytes and few.mask_bytes


def test_a_plan_without_the_period_is_caught_and_every_block_traced(monkeypatch, caplog):
    """The rule without selective AC's period traces 3, 4 and 5 of the debug model's blocks, of which 2, 2 and 3 are
    checkpointed: the activations are off a line, and the estimate goes on to trace every block (which this test
    leaves out: the full trace's figures are the other tests')."""
    cfg = load_config([*DEBUG, *SELECTIVE])
    monkeypatch.setattr(memory_extrapolate, "plan", lambda *args: Plan((3, 4, 5), edge=1, every=1))
    trace, whole = memory._trace, []

    def few_only(cfg, dims, args, vocab_note, of=None, routing="balanced"):
        if of is None:
            whole.append(args.n_layers)
            return "the full trace", None
        return trace(cfg, dims, args, vocab_note, of, routing)

    monkeypatch.setattr(memory, "_trace", few_only)
    with caplog.at_level(logging.INFO, logger=memory.__name__):
        assert estimate_memory(cfg, 1, extrapolate=True) == "the full trace" and whole == [6]
    said = [r.getMessage() for r in caplog.records if r.name == memory.__name__]
    assert "activation_bytes is not affine in the block count: tracing all 6 blocks" in said


def test_the_plan_follows_the_blocks_period_and_edges():
    def plan(world_size, *overrides):
        cfg = load_config(["--job.config_file", "train_configs/llama3_8b.toml", *overrides])
        args = model_args(cfg)[0]
        return memory_extrapolate.plan(cfg, ParallelDims.from_config(cfg.parallelism, world_size), args,
                                       registry.get(cfg.model.name))

    assert plan(8) == Plan((3, 4, 5), edge=1, every=1)  # selective AC by op
    # Every 3rd block: counts of 2 modulo 3, as the model's 32 blocks, so the last blocks line up with its.
    assert plan(8, "--activation_checkpoint.selective_ac_option", "3") == Plan((5, 8, 11), edge=1, every=3)
    assert plan(8, "--parallelism.fsdp_prefetch", "2") == Plan((7, 8, 9), edge=3, every=1)
    assert plan(1, "--parallelism.fsdp_prefetch", "2").edge == 1  # no FSDP: no prefetch
    assert plan(16, "--parallelism.pipeline_parallel_degree", "2") is None  # rank 0's share of the blocks
    filtered = ("--float8.enable_float8_linear", "--float8.filter_fqns")
    assert plan(8, *filtered, "feed_forward") is not None  # the same linears of every block
    assert plan(8, *filtered, "layers.1.") is None  # block 1's, and none of the others'


def _made_up_trace(n: int) -> tuple[Estimate, dict]:
    """A trace of n blocks whose backward segments peak as `_backward` says, (bytes, transient); the figures affine,
    the step's peak the first of the highest segment's."""
    segments = {None: (0, 0), **{("forward", i): (i, 0) for i in range(n)},
                **{("backward", i): _backward(i, n) for i in reversed(range(n))}}
    peak, transient = max(segments.values(), key=lambda v: v[0])
    figures = dict(param_bytes=8 * n, grad_bytes=8 * n, optimizer_bytes=16 * n, activation_bytes=100 + n,
                   transient_bytes=transient, peak_bytes=peak, host_bytes=0, mask_bytes=0)
    return Estimate("made up", 1, "", {}, **figures, traced=(n,)), segments


def _backward(i: int, n: int) -> tuple[int, int]:
    # The last block's backward starts with the loss's gradient, large and growing slowly with the blocks; block
    # i's holds the gradients of the blocks after it and the activations of those before: the first block's grows
    # faster, and overtakes beyond the traced counts.
    return (1000 + 10 * n, 7) if i == n - 1 else (100 * n - 90 * i, 3)


def test_the_peak_comes_from_the_segment_that_overtakes_beyond_the_traced_counts():
    plan = Plan((3, 4, 5), edge=1, every=1)
    traces = [_made_up_trace(n) for n in plan.counts]
    assert [t[0].peak_bytes for t in traces] == [1030, 1040, 1050]  # on a line, which would say 1200 at 20 blocks
    estimate, why = extrapolate(traces, plan, 20)
    assert (estimate.peak_bytes, estimate.transient_bytes, why) == (2000, 3, "")
    assert (estimate.param_bytes, estimate.activation_bytes, estimate.traced) == (160, 120, (3, 4, 5))


def _bump(segments: dict, segment: tuple) -> None:
    segments[segment] = segments[segment][0] + 1, segments[segment][1]


@pytest.mark.parametrize("tweak, why", [
    (lambda n, e, s: setattr(e, "grad_bytes", e.grad_bytes + (n == 4)), "grad_bytes is not affine"),
    (lambda n, e, s: n == 4 and _bump(s, ("backward", 0)), "the peak of the backward of the first block is not"),
    (lambda n, e, s: n == 5 and _bump(s, ("backward", 2)), "the blocks between the edges differ"),
    (lambda n, e, s: setattr(e, "peak_bytes", e.peak_bytes + 1), "the segments' peaks miss the step's"),
])
def test_a_figure_or_segment_off_its_line_refuses_to_extrapolate(tweak, why):
    """Each check on its own: a figure off its line, a segment that may hold the peak off its line, a block between
    the edges off the line of its neighbours, segments that do not account for the step's peak."""
    plan = Plan((3, 4, 5), edge=1, every=1)
    traces = [_made_up_trace(n) for n in plan.counts]
    for n, (estimate, segments) in zip(plan.counts, traces):
        tweak(n, estimate, segments)
    estimate, said = extrapolate(traces, plan, 20)
    assert estimate is None and said.startswith(why)


def test_the_worst_routing_estimate_holds_every_ranks_tokens_on_the_traced_ranks_experts(capsys):
    """--routing worst: under EP 4 rank 0 receives every rank's 128 tokens x min(top 2, its 2 experts) slots, 1,024
    a layer instead of balanced routing's 256; its activations grow by at least each extra slot's input and its two
    hidden projections' outputs (which backward keeps) in both MoE layers, and the table says which routing it
    holds. Without EP a rank computes its own slots whatever the routing: the same figures."""
    moe_run = [*TINY, "--model.flavor", "tiny_moe", "--training.local_batch_size", "2"]
    cfg = load_config([*moe_run, "--parallelism.expert_parallel_degree", "4"])
    balanced, worst = (estimate_memory(cfg, 4, routing=r) for r in ("balanced", "worst"))
    args = model_args(cfg)[0]
    extra_slots, hidden = (1024 - 256) * args.n_layers, args.moe.hidden or args.ffn_hidden
    assert worst.activation_bytes - balanced.activation_bytes >= extra_slots * (args.dim + 2 * hidden) * 4
    assert worst.param_bytes == balanced.param_bytes and worst.optimizer_bytes == balanced.optimizer_bytes
    assert "routed at dropless routing's bound" in script.table(worst, cfg)
    assert "routed at" not in script.table(balanced, cfg)
    plain = load_config(moe_run)
    assert estimate_memory(plain, 4, routing="worst").peak_bytes == estimate_memory(plain, 4).peak_bytes
    assert script.main([*moe_run, "--routing", "most"]) == 2
    assert "--routing expects balanced or worst (got 'most')" in capsys.readouterr().err


def test_with_a_capacity_factor_the_worst_routing_is_the_capacitys_bound():
    """moe.capacity_factor 1 on EP 4 (64-token sequences, top 2 of 8): each expert takes 16 slots of a sequence, so
    a rank sends rank 0's 2 experts at most 2 sequences x 2 x 16 = 64 slots, what balanced routing sends: the worst
    case's figures are the balanced ones', below dropless routing's worst by at least its 768 more slots' inputs and
    hidden outputs in each MoE layer. A factor of 0.5 keeps half of the slots, fewer bytes still."""
    moe_run = [*TINY, "--model.flavor", "tiny_moe", "--training.local_batch_size", "2",
               "--parallelism.expert_parallel_degree", "4"]
    dropless = estimate_memory(load_config(moe_run), 4, routing="worst")
    cfg = load_config([*moe_run, "--moe.capacity_factor", "1"])
    balanced, worst = (estimate_memory(cfg, 4, routing=r) for r in ("balanced", "worst"))
    assert (worst.activation_bytes, worst.peak_bytes) == (balanced.activation_bytes, balanced.peak_bytes)
    args = model_args(cfg)[0]
    extra_slots, hidden = (1024 - 256) * args.n_layers, args.moe.hidden or args.ffn_hidden
    assert dropless.activation_bytes - worst.activation_bytes >= extra_slots * (args.dim + 2 * hidden) * 4
    assert "routed at capacity factor 1's bound" in script.table(worst, cfg)
    half = estimate_memory(load_config([*moe_run, "--moe.capacity_factor", "0.5"]), 4, routing="worst")
    assert half.activation_bytes < worst.activation_bytes and half.param_bytes == worst.param_bytes
