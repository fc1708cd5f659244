"""One training step makes exactly the collectives FSDP2's, Megatron sequence parallelism's and context parallelism's
rules prescribe.

tools/comm_count.py records every collective of step 2 of a real train.py run, for each layout below, all in one
4-process launch (probes.py's, shared with test_syncs.py and test_init_layouts.py). The expected counts are derived here from the model's structure, never read off a run:
- FSDP2 (G = one group per block + the root): in forward one all-gather per group; in backward one per group that
  was resharded after forward ("default": every block but the last; "always": all; "never": none; hpZ: the same
  blocks, gathered within groups of N ranks); one reduce-scatter per group, per micro-batch unless the reduction is
  deferred to the last one; HSDP adds one all-reduce per group across replicas.
- TP with sequence parallelism, per block: 2 all-gathers and 2 reduce-scatters of b·s·h activations in forward (the
  inputs of attention and the FFN; their output projections), the same in backward; the embedding's output
  reduce-scatter and the output layer's input all-gather, each with its backward; the loss-parallel cross-entropy's 3
  all-reduces of b·s (max, sum of exponentials, target logit); one all-reduce per norm weight, whose gradient each
  rank holds partially.
- Context parallelism, per block: one all-gather of the keys and values over cp in forward, one reduce-scatter of
  their gradients in backward; FSDP shards over dp_shard x cp.
- Expert parallelism (tiny_moe, its experts over EP 2 x FSDP 2 of the 4 ranks' dp_shard), per MoE layer: the
  counts' all-to-all over ep, the tokens' there and back in forward, the same two in backward; the experts' own FSDP
  group over efsdp (an all-gather in forward, one in backward, a reduce-scatter); after the update, the load's
  all-reduce (training/expert_load.py). With op-level selective checkpointing the same (its recompute runs no
  all-to-all: their outputs are kept), with full checkpointing 3 all-to-alls a layer more.
- The step itself: the global gradient norm's all-reduce, and the preemption agreement's.
Any other collective, or one more of these, fails. Bytes count the full buffer (all-gather output, reduce-scatter
and all-reduce input): FSDP moves ~3x the parameter bytes per step (ZeRO-3: gather, gather again, reduce).
`python -m pytest -s tests/multiprocess/test_collectives.py -k bytes` prints the table of docs/performance.md.
"""

import json
from collections import Counter

import pytest
import torch

import probes
from launch import FLOAT8, TINY, curve, tiny_model
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
from torchtitan_lite.quantization.float8 import converted_names

pytestmark = pytest.mark.reads("resumed_4p", "probes")

ARGS = tiny_model()
BATCH = 2  # sequences per micro-batch (tiny.toml's local_batch_size)
L = ARGS.n_layers
G = L + 1
WORLD = (0, 1, 2, 3)
OP_SAC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
# name -> (overrides, {ranks of rank 0's group: dimension name})
LAYOUTS = {
    "FSDP 4": ([], {WORLD: "world"}),
    "FSDP 4, reshard never": (["--parallelism.fsdp_reshard_after_forward", "never"], {WORLD: "world"}),
    "FSDP 4, reshard always": (["--parallelism.fsdp_reshard_after_forward", "always"], {WORLD: "world"}),
    "FSDP 4, hpZ 2": (["--parallelism.fsdp_reshard_after_forward", "2"], {WORLD: "world", (0, 1): "hpz"}),
    "FSDP 4, 2 micro-batches": (["--training.global_batch_size", "16"], {WORLD: "world"}),
    "FSDP 4, 2 micro-batches, deferred reduce": (["--training.global_batch_size", "16",
                                                  "--parallelism.fsdp_defer_grad_reduce"], {WORLD: "world"}),
    "HSDP 2 x 2": (["--parallelism.data_parallel_replicate_degree", "2"],
                   {WORLD: "world", (0, 1): "shard", (0, 2): "replicate"}),
    "TP 2 x FSDP 2": (["--parallelism.tensor_parallel_degree", "2"], {WORLD: "world", (0, 2): "shard", (0, 1): "tp"}),
    "CP 2 x FSDP 2": (["--parallelism.context_parallel_degree", "2"], {WORLD: "world", (0, 1): "cp"}),
    "FSDP 4, float8 all-gather": ([*FLOAT8, "--float8.enable_fsdp_float8_all_gather",
                                   "--float8.precompute_float8_dynamic_scale_for_fsdp"], {WORLD: "world"}),
    "MoE, EP 2 x FSDP 2": (["--model.flavor", "tiny_moe", "--parallelism.expert_parallel_degree", "2"],
                           {WORLD: "world", (0, 1): "ep", (0, 2): "efsdp"}),
    "MoE, EP 2 x FSDP 2, op-level AC": (["--model.flavor", "tiny_moe", "--parallelism.expert_parallel_degree", "2",
                                         *OP_SAC], {WORLD: "world", (0, 1): "ep", (0, 2): "efsdp"}),
    "MoE, EP 2 x FSDP 2, full AC": (["--model.flavor", "tiny_moe", "--parallelism.expert_parallel_degree", "2",
                                     "--activation_checkpoint.mode", "full"],
                                    {WORLD: "world", (0, 1): "ep", (0, 2): "efsdp"}),
}
STEP = Counter({("all_reduce", "world"): 2})  # the grad norm, the preemption agreement


def fsdp(dim: str, backward_gathers: int, micro_batches: int = 1, reduces: int | None = None,
         gather_dim: str | None = None) -> Counter:
    forward = Counter({("all_gather", dim): micro_batches * G, ("reduce_scatter", dim): reduces or micro_batches * G})
    return forward + Counter({("all_gather", gather_dim or dim): micro_batches * backward_gathers})


EXPECTED = {
    "FSDP 4": STEP + fsdp("world", L - 1),
    "FSDP 4, reshard never": STEP + fsdp("world", 0),
    "FSDP 4, reshard always": STEP + fsdp("world", G),
    "FSDP 4, hpZ 2": STEP + fsdp("world", L - 1, gather_dim="hpz"),
    "FSDP 4, 2 micro-batches": STEP + fsdp("world", L - 1, micro_batches=2),
    "FSDP 4, 2 micro-batches, deferred reduce": STEP + fsdp("world", L - 1, micro_batches=2, reduces=G),
    "HSDP 2 x 2": STEP + fsdp("shard", L - 1) + Counter({("all_reduce", "replicate"): G}),
    "TP 2 x FSDP 2": STEP + fsdp("shard", L - 1) + Counter({
        ("all_gather", "tp"): 4 * L + 2, ("reduce_scatter", "tp"): 4 * L + 2,
        ("all_reduce", "tp"): (2 * L + 1) + 3}),
    # FSDP over dp_shard x cp (the world); each block all-gathers its keys and values over cp, and reduce-scatters
    # their gradient in backward.
    "CP 2 x FSDP 2": STEP + fsdp("world", L - 1) + Counter({("all_gather", "cp"): L, ("reduce_scatter", "cp"): L}),
    # The float8 weights' scales: one all-reduce of their maxima after the optimizer step (the precompute).
    "FSDP 4, float8 all-gather": STEP + fsdp("world", L - 1) + Counter({("all_reduce", "world"): 1}),
    # The experts' groups reshard after forward, the last block's too.
    "MoE, EP 2 x FSDP 2": STEP + fsdp("world", L - 1) + Counter({
        ("all_gather", "efsdp"): 2 * L, ("reduce_scatter", "efsdp"): L, ("all_to_all", "ep"): 5 * L,
        ("all_reduce", "world"): 1}),
}
# Op-level checkpointing keeps the all-to-alls' outputs: its recompute runs none (parallel/selective_ac.py). Full
# checkpointing runs the forward's three again in backward (the counts, the slots out and back). Either way a block's
# experts are gathered twice: the recompute's gather is the one backward would make.
EXPECTED["MoE, EP 2 x FSDP 2, op-level AC"] = EXPECTED["MoE, EP 2 x FSDP 2"]
EXPECTED["MoE, EP 2 x FSDP 2, full AC"] = EXPECTED["MoE, EP 2 x FSDP 2"] + Counter({("all_to_all", "ep"): 3 * L})


# Every layout's run in turn, 3 steps each, in probes.py's job (its step 2 recorded: comm_count.main).
probes.register("collectives", json.dumps({name: overrides for name, (overrides, _) in LAYOUTS.items()}),
                "--job.config_file", str(TINY), "--training.steps", "3", "--metrics.log_freq", "10")


@pytest.fixture(scope="module")
def calls(probed):
    out = probed / "collectives"
    recorded = {}
    for name, (_, dims) in LAYOUTS.items():
        recorded[name] = [(kind, dims.get(tuple(ranks), str(ranks)), nbytes)
                          for kind, ranks, nbytes in json.loads((out / f"{name}.json").read_text())]
    return recorded


def param_bytes() -> int:
    with torch.device("meta"):
        model = Transformer(ARGS)
    return 4 * sum(p.numel() for p in model.parameters())  # float32


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_step_makes_the_collectives_the_rules_prescribe(calls, layout):
    assert Counter((kind, dim) for kind, dim, _ in calls[layout]) == EXPECTED[layout]


def bytes_of(calls, kind: str, dim: str) -> int:
    return sum(n for k, d, n in calls if (k, d) == (kind, dim))


def print_table(calls, p: int) -> None:
    print("\n| layout | collectives per step (per rank) | MB per rank | x parameter bytes |\n|---|---|---|---|")
    for name, recorded in calls.items():
        counts = Counter((kind, dim) for kind, dim, _ in recorded)
        text = ", ".join(f"{n} {kind.replace('_', '-')} ({dim})" for (kind, dim), n in sorted(counts.items()))
        total = sum(n for _, _, n in recorded)
        print(f"| {name} | {text} | {total / 1e6:.1f} | {total / p:.2f} |")


def test_fsdp_moves_three_times_the_parameter_bytes(calls):
    p = param_bytes()
    print_table(calls, p)  # docs/performance.md's table: shown with pytest -s
    # FSDP pads each parameter's shards to an even split: a few hundred bytes in all.
    always = calls["FSDP 4, reshard always"]
    assert bytes_of(always, "reduce_scatter", "world") == pytest.approx(p, rel=1e-3)
    assert bytes_of(always, "all_gather", "world") == pytest.approx(2 * p, rel=1e-3)
    never = calls["FSDP 4, reshard never"]
    assert bytes_of(never, "all_gather", "world") == pytest.approx(p, rel=1e-3)  # ZeRO-2: no gather in backward
    hsdp = calls["HSDP 2 x 2"]
    assert bytes_of(hsdp, "all_reduce", "replicate") == pytest.approx(p / 2, rel=1e-3)  # the half each shard holds


def test_float8_all_gather_moves_one_byte_per_float8_weight_element(calls):
    """Each block's gather: its float8 linears at 1 byte an element, its norms at their own 4 (packed as bytes in one
    buffer); the root's (embedding, final norm, output, never converted) stays float32."""
    with torch.device("meta"):
        model = Transformer(ARGS)
    float8 = {f"{name}.weight" for name in converted_names(model, [])}
    padded = {n: -(-p.shape[0] // len(WORLD)) * len(WORLD) * p[0].numel() for n, p in model.named_parameters()}
    block = {n: padded[n] for n, _ in model.layers["0"].named_parameters(prefix="layers.0")}  # FSDP's even shards
    block_bytes = sum(n * (1 if name in float8 else 4) for name, n in block.items())
    root = 4 * sum(n for name, n in padded.items() if not name.startswith("layers."))
    gathers = [n for k, _, n in calls["FSDP 4, float8 all-gather"] if k == "all_gather"]
    plain = [n for k, _, n in calls["FSDP 4"] if k == "all_gather"]
    assert sorted(gathers) == sorted([block_bytes] * (2 * L - 1) + [root])
    assert block_bytes <= 0.26 * 4 * sum(block.values())  # a float32 gather would be 4x
    assert sum(gathers) <= 0.3 * sum(plain)


def test_tp_moves_activations_of_b_s_h(calls):
    tp = [(k, n) for k, d, n in calls["TP 2 x FSDP 2"] if d == "tp"]
    activation = BATCH * ARGS.max_seq_len * ARGS.dim * 4
    assert all(n == activation for k, n in tp if k != "all_reduce")
    # Norm weights' partial gradients (dim floats each) and the loss's statistics (b·s floats each).
    reduced = sorted(n for k, n in tp if k == "all_reduce")
    assert reduced == [BATCH * ARGS.max_seq_len * 4] * 3 + [ARGS.dim * 4] * (2 * L + 1)


def test_cp_moves_the_whole_sequences_keys_and_values(calls):
    # Each block gathers b·s keys and values of its kv heads (the whole sequence, every rank's share), and backward
    # reduce-scatters their gradient, the same size.
    cp = [(k, n) for k, d, n in calls["CP 2 x FSDP 2"] if d == "cp"]
    kv = BATCH * ARGS.max_seq_len * 2 * ARGS.kv_heads * ARGS.head_dim * 4
    assert sorted(cp) == [("all_gather", kv)] * L + [("reduce_scatter", kv)] * L


def test_expert_parallelism_sends_each_tokens_k_slots_and_the_counts(calls):
    """Per MoE layer: the counts (E int64s); this rank's slots (b·s·k rows of dim floats) out in forward and their
    gradients back in backward; what its experts received, back in forward and out in backward (the data's, at most
    all of the ep group's slots)."""
    moe = FLAVORS["tiny_moe"].moe
    sent = sorted(n for k, d, n in calls["MoE, EP 2 x FSDP 2"] if k == "all_to_all")
    slots = BATCH * ARGS.max_seq_len * moe.top_k * ARGS.dim * 4
    assert sent.count(moe.num_experts * 8) == L and sent.count(slots) >= 2 * L
    received = sent[L:]
    for n in (slots,) * (2 * L):
        received.remove(n)
    assert len(received) == 2 * L and all(0 <= n <= 2 * slots for n in received)


def test_op_level_checkpointing_under_expert_parallelism_recomputes_the_same_numbers(calls, probed):
    """Beside its count of all-to-alls (the run's without checkpointing, above), the recompute gives the forward's
    numbers: the three runs' curves (fp32, 3 steps, logged at the first and the last) bit for bit; in bf16 every
    gradient too (test_moe_layouts.py)."""
    plain = curve(probed / "collectives" / "MoE, EP 2 x FSDP 2")
    assert sorted(plain) == [1, 3]
    for checkpointed in ("MoE, EP 2 x FSDP 2, op-level AC", "MoE, EP 2 x FSDP 2, full AC"):
        assert curve(probed / "collectives" / checkpointed) == plain, checkpointed
