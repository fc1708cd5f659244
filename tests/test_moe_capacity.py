"""The expert capacity (models/common/capacity.py, moe.capacity_factor): which slots it drops, against a plain loop
of its rule; a layer with it against a token-by-token loop over the kept slots, forward and backward; a sequence split
across ranks (parallel/sequence_slots.py) dropping one process's slots; 0 running the dropless code unchanged; the
load's `dropped`; and its config. The layouts with real processes are test_moe_layouts.py's (run_table's E6 rows)."""

import threading

import pytest
import torch
import torch.nn.functional as F

from torchtitan_lite.config import ConfigError, help_text, load_config
from torchtitan_lite.models import registry
from torchtitan_lite.models.common import capacity
from torchtitan_lite.models.common.layers import FeedForward
from torchtitan_lite.models.common.moe import MoE, MoEArgs
from torchtitan_lite.models.init import trunc_normal_
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.sequence_slots import EarlierSlots, held_ranges
from torchtitan_lite.training.expert_load import ExpertLoad
from torchtitan_lite.training.preflight import check_layout
from launch import TINY


def layer(args: MoEArgs, dim: int = 32, hidden: int = 48) -> MoE:
    shared = FeedForward(dim, args.shared_experts * hidden) if args.shared_experts else None
    m = MoE(dim, hidden, args, shared)
    names = {p: n for n, p in m.named_parameters()}
    m.init_weights(lambda p, std: trunc_normal_(p, std, float("inf"), key=f"7/{names[p]}"), 0.1)
    return m


def skewed_routes(sequences: int, tokens: int, k: int, experts: int, seed: int = 0) -> torch.Tensor:
    """(sequences, tokens, k) distinct experts a token, expert 0 chosen far more often than the rest: it overflows."""
    g = torch.Generator().manual_seed(seed)
    odds = torch.tensor([6.0] + [1.0] * (experts - 1))
    return torch.stack([torch.multinomial(odds, k, generator=g) for _ in range(sequences * tokens)]).view(
        sequences, tokens, k)


def loop_kept(routes: torch.Tensor, limit: int) -> list[list[list[bool]]]:
    """The rule as written: in each sequence, walk the positions in order; a slot is kept while its expert has taken
    fewer than `limit` of the sequence's slots."""
    kept = []
    for sequence in routes.tolist():
        taken, rows = {}, []
        for choices in sequence:
            rows.append([taken.get(e, 0) < limit for e in choices])
            for e in choices:
                taken[e] = taken.get(e, 0) + 1
        kept.append(rows)
    return kept


def test_the_capacity_is_megatrons_per_sequence():
    """ceil(seq_len x top_k / num_experts x factor): Megatron's get_capacity with a sequence's tokens."""
    assert capacity.capacity(1.0, 64, 2, 8) == 16 and capacity.capacity(1.0, 64, 2, 6) == 22
    assert capacity.capacity(0.5, 64, 2, 8) == 8 and capacity.capacity(1.25, 64, 2, 6) == 27
    assert capacity.capacity(4.0, 64, 2, 8) == 64  # as many as the sequence's tokens: nothing can drop


@pytest.mark.parametrize("k, experts, limit", [(1, 4, 5), (2, 6, 7), (3, 6, 9)])
def test_the_kept_slots_are_a_plain_loops_over_positions(k, experts, limit):
    routes = skewed_routes(3, 40, k, experts, seed=k)
    got = capacity.kept(routes, experts, limit)
    assert got.tolist() == loop_kept(routes, limit)
    assert ((routes == 0) & ~got).any(-1).any(-1).all() and got.any()  # expert 0 overflows in every sequence
    per_sequence = torch.stack([(routes == e) & got for e in range(experts)]).flatten(2).sum(-1)
    assert per_sequence.max() == limit  # no expert takes more than its capacity of any sequence


def reference(m: MoE, x: torch.Tensor, keep: list) -> torch.Tensor:
    """Token by token: the router's top k and weights, each kept slot's expert, the shared expert; a dropped slot
    adds nothing (no renormalization)."""
    a, out = m.args, []
    rows = x.reshape(-1, x.shape[-1])
    flat_keep = [choice for sequence in keep for choice in sequence]
    for token, kept in zip(rows, flat_keep):
        scores = (m.router.gate.weight @ token).float().softmax(-1)
        top = scores.topk(a.top_k)
        w = top.values / top.values.sum()
        y = sum(wi * (m.experts.w2[e] @ (F.silu(m.experts.w1[e] @ token) * (m.experts.w3[e] @ token)))
                for wi, e, on in zip(w, top.indices.tolist(), kept) if on)
        out.append(y + m.shared_experts(token))
    return torch.stack(out).view(x.shape)


def test_a_layer_drops_the_slots_over_capacity_and_trains_only_the_kept_ones():
    """Forward, and the gradients of the input, the router and every expert, as the token-by-token loop over the
    kept slots gives them (a gradient through a dropped slot's weight would move the router's); the shared expert
    still applies; the router counts its choices and the layer its dropped slots."""
    m = layer(MoEArgs(num_experts=4, top_k=2, shared_experts=1, capacity_factor=0.75))
    x = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with torch.no_grad():
        routes = m.router(x.reshape(-1, 32))[1].view(3, 16, 2)
    keep = loop_kept(routes, capacity.capacity(0.75, 16, 2, 4))  # 6 slots an expert a sequence
    dropped = sum(not on for sequence in keep for choices in sequence for on in choices)
    assert 0 < dropped < 3 * 16 * 2
    grads = []
    for compute in (m, lambda x: reference(m, x, keep)):
        m.zero_grad()
        xi = x.detach().clone().requires_grad_()
        y = compute(xi)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        grads.append([y, xi.grad, *(p.grad for p in m.parameters())])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert m.router.tokens_per_expert.sum() == 3 * 16 * 2 and m.drop_sum == dropped


def test_a_capacity_factor_of_0_runs_todays_dropless_code(monkeypatch):
    """0 never reaches the capacity's code (made to raise here); a capacity no expert can fill gives the dropless
    layer's bits, output and every gradient; and a model in eval mode (generation) computes every slot."""
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(2))
    outs = {}
    for factor in (0.0, 2.0, 0.5):  # 2.0 = num_experts / top_k: C is the sequence's length
        m = layer(MoEArgs(num_experts=4, top_k=2, capacity_factor=factor))
        y = m(x.clone().requires_grad_())
        y.square().sum().backward()
        outs[factor] = [y, *(p.grad for p in m.parameters())]
        if factor == 0.5:
            assert m.drop_sum > 0
            assert torch.equal(m.eval()(x), outs[0.0][0].detach())
    assert all(torch.equal(a, b) for a, b in zip(outs[0.0], outs[2.0]))

    def refused(*args):
        raise AssertionError("the capacity's code ran with moe.capacity_factor 0")

    monkeypatch.setattr(capacity, "kept", refused)
    monkeypatch.setattr(capacity, "kept_count", refused)
    m = layer(MoEArgs(num_experts=4, top_k=2))
    m(x).sum().backward()
    assert m.drop_sum == 0


@pytest.mark.parametrize("cp, tp, balancer", [(2, 1, "headtail"), (2, 2, "headtail"), (1, 4, "none"),
                                              (2, 3, "headtail"), (4, 1, "none"), (3, 2, "headtail")])
def test_a_sequence_split_across_ranks_drops_the_slots_one_process_drops(cp, tp, balancer):
    """Context parallelism's chunks (head-tail: not adjacent), then sequence parallelism's parts of them (with tp 3, a
    part that spans two chunks): each simulated rank, a thread, counts its slots and adds the earlier ones of the
    others, through a stand-in all-gather; joined by position, their kept slots are one process's."""
    seq_len, k, experts = 72, 2, 6
    routes = skewed_routes(2, seq_len, k, experts, seed=cp * tp)
    limit = capacity.capacity(1.0, seq_len, k, experts)
    ranks = [(c, t) for c in range(cp) for t in range(tp)]
    held = {r: held_ranges(seq_len, cp, r[0], tp, r[1], balancer) for r in ranks}
    positions = sorted(p for ranges in held.values() for start, stop in ranges for p in range(start, stop))
    assert positions == list(range(seq_len))  # every position held once
    pieces, rows, meet, got = max(map(len, held.values())), [None] * len(ranks), threading.Barrier(len(ranks)), {}

    def run(i: int, rank: tuple[int, int]) -> None:
        def gather(mine: torch.Tensor) -> torch.Tensor:
            rows[i] = mine
            meet.wait()
            return torch.cat(rows)

        split = EarlierSlots(seq_len, held[rank], pieces, i, gather)
        index = torch.cat([torch.arange(start, stop) for start, stop in held[rank]])
        got[rank] = (index, capacity.kept(routes[:, index], experts, limit, split))

    threads = [threading.Thread(target=run, args=(i, r)) for i, r in enumerate(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    joined = torch.zeros(2, seq_len, k, dtype=torch.bool)
    for index, kept in got.values():
        joined[:, index] = kept
    want = capacity.kept(routes, experts, limit)
    assert (~want).any() and torch.equal(joined, want)


def test_the_balancing_counts_the_routers_choices_dropped_slots_among_them():
    """The selection bias's counts and the auxiliary loss are the dropless layer's, to the bit, where half of the
    slots or more are dropped (4 experts of 6 slots a 24-token sequence, top 2; docs/moe.md says why)."""
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(4))
    layers = [layer(MoEArgs(num_experts=4, top_k=2, aux_loss_coeff=0.02, load_balance_coeff=1e-3,
                            capacity_factor=factor)) for factor in (0.5, 0.0)]
    for m in layers:
        m(x).sum().backward()
    tight, dropless = layers
    assert tight.drop_sum > 0 and torch.equal(tight.aux_sum, dropless.aux_sum)
    assert torch.equal(tight.router.tokens_per_expert, dropless.router.tokens_per_expert)


def test_the_load_logs_the_fraction_dropped_with_a_capacity_alone():
    on, off = layer(MoEArgs(num_experts=4, top_k=2, capacity_factor=0.5)), layer(MoEArgs(num_experts=4, top_k=2))
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(3))
    for m in (on, off):
        m(x).sum().backward()
    dropped = on.drop_sum.item()
    load = ExpertLoad(torch.nn.ModuleDict({"on": on}), group=lambda: None)
    load()
    assert dropped > 0 and load.fields()["dropped"] == dropped / (2 * 16 * 2) and on.drop_sum == 0
    load = ExpertLoad(torch.nn.ModuleDict({"off": off}), group=lambda: None)
    load()
    assert "dropped" not in load.fields()


def check(world: int, *overrides: str) -> None:
    cfg = load_config(["--job.config_file", str(TINY), "--model.flavor", "tiny_moe", *overrides])
    check_layout(cfg, ParallelDims.from_config(cfg.parallelism, world), registry.get("llama3").run_args(cfg, 256))


def test_a_factor_that_leaves_an_expert_less_than_a_slot_is_refused_in_one_line(error_line):
    """tiny.toml's 64-token sequences, top 2 of 8: 0.0625 gives each expert exactly one slot, less would round up
    to one and train with another factor than the config's. Negative, NaN and inf are the key's rule's."""
    check(1, "--moe.capacity_factor", "0.0625")
    with pytest.raises(ConfigError, match=r"moe.capacity_factor 0.05 gives each expert 0.8 slots of a 64-token "
                                          r"sequence \(x 2 / 8 experts\), less than one: use at least 0.0625, or 0"):
        check(1, "--moe.capacity_factor", "0.05")
    assert "--moe.capacity_factor float|none = none  must be none or >= 0 and finite (0 = dropless)" in help_text()
    line = error_line(1, ["--model.flavor", "tiny_moe", "--moe.capacity_factor", "-1"])
    assert "moe.capacity_factor must be none or >= 0 and finite (0 = dropless) (got -1" in line, line
    line = error_line(1, ["--model.flavor", "tiny_moe", "--moe.capacity_factor", "1", "--compile.enable",
                          "--training.mixed_precision_param", "bfloat16", "--moe.aux_loss_coeff", "0"])
    assert "with a capacity factor eager so far" in line and "moe.capacity_factor 0" in line, line
