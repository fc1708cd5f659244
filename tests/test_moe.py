"""The mixture-of-experts feed-forward (models/common/moe.py) in Llama's blocks: routing, dropless expert compute by
grouped GEMM equal to the per-expert loop, the layers it replaces, its init, its FLOPs, one process training it, and
what --check refuses while its other parallelisms are not built (tests/multiprocess/test_moe_layouts.py: the
data-parallel layouts)."""

import pytest
import torch

from torchtitan_lite.checkpoint.reader import read_tensors
from torchtitan_lite.config import load_config
from torchtitan_lite.models import registry
from torchtitan_lite.models.common import moe
from torchtitan_lite.models.init import fill_block_, trunc_normal_
from torchtitan_lite.models.common.decoder import flops_per_token
from torchtitan_lite.models.common.layers import FeedForward
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
from torchtitan_lite.models.common.moe import MoE, MoEArgs
from torchtitan_lite.parallel.expert_parallel import regroup_by_expert
from torchtitan_lite.training.expert_load import ExpertLoad
from torchtitan_lite.tools.memory import estimate_memory
import train
from launch import ROOT, TINY, read_metrics, train_in_process


def layer(args: MoEArgs, dim: int = 64, hidden: int = 96, seed: int = 0) -> MoE:
    shared = FeedForward(dim, args.shared_experts * hidden) if args.shared_experts else None
    m = MoE(dim, hidden, args, shared)
    names = {p: n for n, p in m.named_parameters()}
    m.init_weights(lambda p, std: trunc_normal_(p, std, float("inf"), key=f"{seed}/{names[p]}"), 0.02)
    return m


def naive(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax/sigmoid scores, the top k, each chosen expert's SwiGLU, weighted."""
    a, out = m.args, []
    for token in x.reshape(-1, x.shape[-1]):
        logits = (m.router.gate.weight @ token).float()
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        top = scores.topk(a.top_k)
        w = top.values / top.values.sum() if a.renormalize else top.values
        y = sum(wi * a.route_scale * (m.experts.w2[e] @ (torch.nn.functional.silu(m.experts.w1[e] @ token) *
                                                         (m.experts.w3[e] @ token)))
                for wi, e in zip(w, top.indices.tolist()))
        if m.shared_experts is not None:
            y = y + m.shared_experts(token)
        out.append(y)
    return torch.stack(out).view(x.shape)


@pytest.mark.parametrize("args", [MoEArgs(), MoEArgs(top_k=1), MoEArgs(num_experts=4, top_k=3, shared_experts=2),
                                  MoEArgs(score_func="sigmoid", route_scale=2.5),
                                  MoEArgs(score_func="sigmoid", renormalize=False)],
                         ids=["mixtral", "top1", "shared", "sigmoid_scaled", "sigmoid_raw"])
def test_every_token_reaches_its_top_k_experts_weighted_as_its_router_says(args):
    m = layer(args)
    x = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(m(x), naive(m, x), rtol=1e-5, atol=1e-6)


def test_grouped_gemm_equals_the_loop_over_experts_bitwise_forward_and_backward():
    """Uneven groups and an expert no token chose: the one kernel and the loop give the same bits, gradients too."""
    m = layer(MoEArgs())
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    counts = torch.tensor([9, 0, 14, 3, 1, 6, 0, 7])
    assert moe.grouped_mm_fits(x, m.experts.w1)
    outs = []
    for mm in (moe.grouped, moe.looped):
        xi = x.clone().requires_grad_()
        w = m.experts.w1.detach().clone().requires_grad_()
        y = mm(xi, w, counts)
        y.backward(torch.arange(y.numel(), dtype=y.dtype).view_as(y).sin())
        outs.append((y, xi.grad, w.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert outs[0][2][1].abs().sum() == 0 and outs[0][2][6].abs().sum() == 0  # no token, no gradient


def test_a_layer_computes_the_same_bits_by_grouped_gemm_as_by_the_loop(monkeypatch):
    m = layer(MoEArgs())
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))
    grouped = m(x)
    monkeypatch.setattr(moe, "grouped_mm_fits", lambda *_: False)
    assert torch.equal(m(x), grouped)
    assert not moe.grouped_mm_fits(torch.zeros(4, 6), torch.zeros(2, 10, 6))  # 24-byte rows: the loop


@pytest.mark.parametrize("dtype, kernel", [(torch.bfloat16, "grouped"), (torch.float16, "looped")])
def test_under_autocast_the_experts_compute_as_the_layer_held_in_its_dtype(monkeypatch, dtype, kernel):
    """Autocast casts nn.Linear's operands, not grouped_mm's: the experts cast theirs, so a one-process bf16 run takes
    the one kernel (fp16, which it lacks, the loop) and gets the bits of the layer held in that dtype with its gate in
    fp32 (what FSDP2's mixed precision computes, from tokens it holds in that dtype), with fp32 gradients for every
    fp32 parameter."""
    m, used = layer(MoEArgs()), []
    for name in ("grouped", "looped"):
        monkeypatch.setattr(moe, name, lambda *a, f=getattr(moe, name), name=name: used.append(name) or f(*a))
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(6)).to(dtype).float()
    with torch.autocast("cpu", dtype=dtype):
        y = m(x)
    y.square().sum().backward()
    assert set(used) == {kernel}
    held = layer(MoEArgs())
    held.experts.to(dtype)
    assert torch.equal(y.to(dtype), held(x.to(dtype)))
    for name, p in m.named_parameters():
        assert p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0, name


def test_a_compiled_layer_in_bf16_is_one_graph_that_no_routing_recompiles():
    """Inductor, fullgraph: no host read of the counts (the loop's .tolist() fails to lower; aot_eager would take it),
    no bincount's data-dependent length; the steps after the first route differently and reuse its graph."""
    from torch._dynamo.utils import counters  # noqa: PLC0415 - compile's own bookkeeping

    torch._dynamo.reset()
    counters.clear()
    m = layer(MoEArgs()).bfloat16()
    compiled, graphs = torch.compile(m, fullgraph=True), []
    for step in range(3):
        x = torch.randn(48, 64, generator=torch.Generator().manual_seed(step)).bfloat16()
        y = compiled(x)
        y.float().square().sum().backward()
        eager = m(x)  # inductor fuses in fp32 what eager rounds to bf16: a few bf16 roundings apart
        assert (y - eager).abs().max() <= 0.02 * eager.abs().max()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1, 1], graphs


def test_the_router_scores_in_fp32_and_orders_each_tokens_experts_by_score():
    router = layer(MoEArgs(num_experts=6, top_k=3)).router
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    router.gate.weight.data = router.gate.weight.data.bfloat16()
    weights, experts, *_ = router(x)
    assert weights.dtype == torch.float32 and experts.shape == (50, 3)
    scores = torch.nn.functional.linear(x.float(), router.gate.weight.float()).softmax(-1)  # bf16 values, fp32 matmul
    assert torch.equal(scores.gather(-1, experts) / scores.gather(-1, experts).sum(-1, keepdim=True), weights)
    assert (scores.gather(-1, experts).diff(dim=-1) <= 0).all()


def test_the_expert_bias_chooses_the_experts_and_the_scores_weigh_them():
    m = layer(MoEArgs(num_experts=6, top_k=2, load_balance_coeff=1e-3))
    m.router.expert_bias[4] = 10.0
    x = torch.randn(30, 64, generator=torch.Generator().manual_seed(7))
    weights, experts, *_ = m.router(x)
    scores = m.router.gate(x).float().softmax(-1)
    assert (experts[:, 0] == 4).all()
    chosen = scores.gather(-1, experts)
    assert torch.equal(weights, chosen / chosen.sum(-1, keepdim=True))


def test_the_router_counts_the_training_forward_once_not_validation_or_a_recompute():
    """Activation checkpointing runs the forward again in backward: counted twice, the load would read double. The
    auxiliary loss is computed in the recompute too (checkpointing checks that it saves what the forward saved) and
    trained once, its value and gradient those of the run without checkpointing."""
    m = layer(MoEArgs(aux_loss_coeff=0.5))
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(8))
    torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False).sum().backward()
    assert m.router.tokens_per_expert.sum() == 20 * 2
    grad, aux, m.router.tokens_per_expert[:] = m.router.gate.weight.grad.clone(), m.aux_sum.clone(), 0
    m.zero_grad()
    m.aux_sum.zero_()
    m(x).sum().backward()
    assert m.router.tokens_per_expert.sum() == 20 * 2 and torch.equal(m.aux_sum, aux)
    torch.testing.assert_close(m.router.gate.weight.grad, grad)
    with torch.no_grad():
        m(x)
    assert m.router.tokens_per_expert.sum() == 20 * 2


def aux_gradient(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The router's gradient from the auxiliary loss alone: backward from the output with a zero gradient, which
    reaches the loss's term through the router's weights (models/moe.WithLoss)."""
    m.zero_grad()
    (m(x) * 0).sum().backward()
    return m.router.gate.weight.grad.clone()


def test_the_auxiliary_loss_trains_as_if_added_to_the_loss_and_sums_over_sequences():
    """Backward gives the loss its coefficient times the step's seed (the loss scale) as gradient: the router's
    gradient is that of coeff x balance_loss computed apart, and doubles with the seed. Each sequence's term is from
    its own tokens: however the global batch is cut into ranks and micro-batches, the loss and the router's gradient
    are the same sums (statistics pooled over a micro-batch would not be)."""
    m = layer(MoEArgs(aux_loss_coeff=0.3))
    x = torch.randn(4, 10, 64, generator=torch.Generator().manual_seed(9))
    grad = aux_gradient(m, x)
    whole = m.aux_sum.clone()
    m.zero_grad()
    _, experts, scores, _ = m.router(x.view(40, 64))
    (0.3 * moe.balance_loss(scores.view(4, 10, -1), experts.view(4, -1), 2)).backward()
    torch.testing.assert_close(m.router.gate.weight.grad, grad)
    m.aux_seed = 2.0
    torch.testing.assert_close(aux_gradient(m, x), 2 * grad)
    m.aux_seed, m.aux_sum[...] = 1.0, 0
    m.zero_grad()
    for i in range(4):
        (m(x[i:i + 1]) * 0).sum().backward()
    assert abs(whole.item() - m.aux_sum.item()) <= 1e-6 * whole.item()
    torch.testing.assert_close(m.router.gate.weight.grad, grad, rtol=1e-5, atol=1e-7)
    assert grad.abs().sum() > 0


def test_the_router_z_loss_is_switch_transformers_mean_over_tokens_and_layers():
    """ST-MoE's router z-loss against transformers' (SwitchTransformers' router_z_loss_func, given every layer's gate
    logits at once: the mean over the layers' tokens, as ExpertLoad's factors make ours), its value logged before the
    weight, its gradient the weight times the formula's, beside the auxiliary loss's (both on)."""
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    args = MoEArgs(router_z_loss=0.2, aux_loss_coeff=0.3)
    layers = torch.nn.ModuleDict({"a": layer(args, seed=1), "b": layer(args, seed=2)})
    load = ExpertLoad(layers, group=lambda: None, sequences=2, seq_len=10)
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(10))
    (layers["a"](x) * 0 + layers["b"](x) * 0).sum().backward()  # the losses' gradients alone
    ours = [m.router.gate.weight.grad.clone() for m in layers.values()]
    load()
    logged = load.fields()
    layers.zero_grad()
    logits = torch.cat([m.router.gate(x).float() for m in layers.values()])  # (layers x sequences, tokens, E)

    def balance(m: MoE) -> torch.Tensor:
        _, experts, scores, _ = m.router(x.view(20, 64))
        return moe.balance_loss(scores.view(2, 10, -1), experts.view(2, -1), 2)

    aux = sum(balance(m) for m in layers.values())
    (0.2 * router_z_loss_func(logits)).backward()
    z_only = [m.router.gate.weight.grad.clone() for m in layers.values()]
    assert abs(logged["router_z_loss"] - router_z_loss_func(logits).item()) <= 1e-6 * logged["router_z_loss"]
    layers.zero_grad()
    (0.3 * aux / (2 * 2)).backward()  # the auxiliary loss's mean over sequences and layers
    for got, z, a in zip(ours, z_only, [m.router.gate.weight.grad for m in layers.values()]):
        torch.testing.assert_close(got, z + a)
        assert z.abs().max() > 0.1 * a.abs().max()  # the z-loss's share is not lost in the sum


def test_expert_load_moves_each_bias_toward_balance_and_logs_the_load():
    m = layer(MoEArgs(num_experts=4, top_k=1, load_balance_coeff=0.5))
    load = ExpertLoad(torch.nn.ModuleDict({"moe": m}), group=lambda: None)
    m.router.tokens_per_expert.copy_(torch.tensor([6.0, 1.0, 1.0, 0.0]))
    load()
    # sign(mean 2 - load) = -1, 1, 1, 1, times 0.5, less its mean 0.25
    assert m.router.expert_bias.tolist() == [-0.75, 0.25, 0.25, 0.25]
    assert m.router.tokens_per_expert.sum() == 0
    assert load.fields() == {"routed_slots": 8.0, "expert_load/moe": 3.0}


def test_every_parameter_gets_a_gradient():
    m = layer(MoEArgs(shared_experts=1))
    m(torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(5))).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("every, first_dense, moe_layers", [(1, 0, [0, 1, 2, 3, 4, 5]), (2, 0, [1, 3, 5]),
                                                            (1, 2, [2, 3, 4, 5]), (2, 2, [3, 5])])
def test_the_blocks_it_replaces_are_every_kth_after_the_first_dense_ones(every, first_dense, moe_layers):
    args = FLAVORS["debugmodel_moe"].with_(vocab_size=64, moe=MoEArgs(every=every, first_dense=first_dense))
    with torch.device("meta"):
        model = Transformer(args)
    assert [int(i) for i, block in model.layers.items() if block.moe is not None] == moe_layers
    assert all((block.feed_forward is None) == block.moe_enabled for block in model.layers.values())


def test_an_experts_initial_weights_depend_on_its_global_index_alone():
    """What expert parallelism needs: the experts 4-7 a rank of EP 2 holds start as they do in the whole tensor."""
    full = torch.empty(8, 96, 64)
    fill_block_(full, (8, 96, 64), (0, 0, 0), 0.02, float("inf"), "0/layers.0.moe.experts.w1")
    half = torch.empty(4, 96, 64)
    fill_block_(half, (8, 96, 64), (4, 0, 0), 0.02, float("inf"), "0/layers.0.moe.experts.w1")
    assert torch.equal(half, full[4:])


def test_mfu_counts_the_parameters_a_token_uses():
    """Mixtral 8x7B: 46.7B parameters, 12.9B of them active (two of eight experts), as published."""
    with torch.device("meta"):
        model = Transformer(FLAVORS["mixtral_8x7b"].with_(vocab_size=32000))
    total = sum(p.numel() for p in model.parameters())
    assert round(total / 1e9, 1) == 46.7 and round((total - moe.inactive_params(model)) / 1e9, 1) == 12.9
    dense = FLAVORS["mixtral_8x7b"].with_(vocab_size=32000, moe=MoEArgs(num_experts=2, top_k=2, hidden=14336))
    with torch.device("meta"):
        both = Transformer(dense)  # every expert of two active: what 8 experts top-2 computes per token
    router = 32 * 4096 * (8 - 2)  # but the router scores all 8: 6 more per block
    assert flops_per_token(model, 4096) == flops_per_token(both, 4096) + 6 * router  # 6 FLOPs a parameter


def test_one_process_trains_every_weight_of_the_moe_model(tmp_path):
    # Without weight decay, which moves every weight, gradient or not: a weight unchanged from step 2 to step 4 is one
    # that got no gradient.
    run = train_in_process(tmp_path, "--model.flavor", "tiny_moe", "--training.steps", "4", "--checkpoint.enable",
                           "--checkpoint.interval", "2", "--optimizer.weight_decay", "0")
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 4 and losses[-1] < losses[0], run.stdout[-2000:]
    step2, step4 = (read_tensors(str(tmp_path / "checkpoint" / f"step-{s}")) for s in (2, 4))
    params = [name for name in step4 if name.startswith("model.")]
    assert {"model.layers.0.moe.router.gate.weight", "model.layers.1.moe.experts.w2"} <= set(params)
    for name in params:
        assert not torch.equal(step2[name], step4[name]), f"{name} did not train"


@pytest.mark.parametrize("name, world", [("mixtral_8x7b", 32), ("mixtral_8x22b", 128)])
def test_the_mixtral_configs_pass_the_check_on_the_gpus_they_name(monkeypatch, capsys, tmp_path, name, world):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    config = ROOT / "train_configs" / f"{name}.toml"
    assert f"on {world} GPUs" in config.read_text().splitlines()[0]
    assert train.run(["--job.config_file", str(config), "--model.tokenizer_path", "", "--training.dataset", "synthetic",
                      "--job.dump_folder", str(tmp_path)], check=True) == 0, capsys.readouterr().err
    assert "experts over ep 8 of dp_shard" in capsys.readouterr().out


def test_regrouping_takes_arrived_slots_from_source_rank_order_to_expert_order():
    """Blocks (rank i, expert e) of sizes[i][e] rows, empty ones among them, taken to (e, i) order."""
    sizes = torch.tensor([[2, 0, 1], [1, 3, 0], [0, 2, 2]])
    arrived, blocks, at = torch.arange(int(sizes.sum())), {}, 0
    for i in range(3):
        for e in range(3):
            blocks[i, e] = arrived[at:at + sizes[i, e]].tolist()
            at += sizes[i, e]
    expected = [row for e in range(3) for i in range(3) for row in blocks[i, e]]
    assert regroup_by_expert(sizes, int(sizes.sum())).tolist() == expected


def test_the_memory_estimate_holds_every_expert_once_on_every_layout():
    """One process holds every parameter (fp32, 4 bytes); 4 ranks without EP, with EP 2 (x FSDP 2 for the experts)
    and EP 2 over TP 2 each a quarter of them, the experts' 3-D weights split evenly (tests/multiprocess/
    test_estimate_memory.py compares such figures with the trainer's own, byte for byte); 32 ranks, EP 8, a 32nd:
    each rank's one expert sharded on its dim 1 over the 4 efsdp ranks (on dim 0, padded, each would hold its whole
    expert: 4x). The routing a fake tensor lacks is taken as even (tools/memory.py)."""
    base = ["--job.config_file", str(TINY), "--model.flavor", "tiny_moe"]
    whole = estimate_memory(load_config(base), 1)
    with torch.device("meta"):
        args = registry.get("llama3").run_args(load_config(base), whole.vocab_size)
        n_params = sum(p.numel() for p in Transformer(args).parameters())
    assert whole.param_bytes == 4 * n_params and whole.activation_bytes > 0
    for layout in ([], ["--parallelism.expert_parallel_degree", "2"],
                   ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"]):
        quarter = estimate_memory(load_config([*base, *layout]), 4)
        assert whole.param_bytes <= 4 * quarter.param_bytes <= 1.01 * whole.param_bytes, layout
    ep8 = estimate_memory(load_config([*base, "--training.global_batch_size", "64",
                                       "--parallelism.expert_parallel_degree", "8"]), 32)
    assert whole.param_bytes <= 32 * ep8.param_bytes <= 1.01 * whole.param_bytes
