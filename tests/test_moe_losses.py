"""A mixture of experts' auxiliary losses and load (models/common/moe.py, training/expert_load.py) against what the
code does not derive from itself: DeepSeek-V3's sequence-wise balance loss as its paper writes it, a step whose loss
is scaled (fp16) and a real fp16 run, and compiled blocks' counts in real runs. The Switch/Mixtral loss with softmax
scores is checked against transformers' in tests/test_hf_mixtral.py."""

import math
from dataclasses import replace

import pytest
import torch

from grad_dump import NUMBERS, load_grads, recording
from launch import TINY, read_metrics, train_in_process
from tests.test_moe import aux_gradient, layer
from tests.test_step import FP32, batch
from torchtitan_lite.checkpoint.reader import read_tensors
from torchtitan_lite.config import load_config
from torchtitan_lite.models import registry
from torchtitan_lite.models.common import moe
from torchtitan_lite.models.common.moe import MoEArgs
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
from torchtitan_lite.training.step import Step


def deepseek_balance_loss(gate: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss at alpha 1, summed over the sequences of `x` (sequences, T, dim), as its
    paper writes it, one token and one expert at a time in float64: s_it = sigmoid(gate_i . x_t), f_i = N/(K T) x the
    tokens whose chosen experts include i, s'_it = s_it / sum_j s_jt, P_i = (1/T) sum_t s'_it, L = sum_i f_i P_i. A
    token's k experts are the top k of s_t + `bias` (the selection bias; None: of s_t alone). Differentiable in
    `gate`, through P (the choice, f, carries no gradient)."""
    total, n = torch.zeros((), dtype=torch.float64), gate.shape[0]
    for sequence in x.double():
        length = len(sequence)
        scores = [[torch.sigmoid(gate[i] @ token) for i in range(n)] for token in sequence]
        chosen = []
        for s in scores:
            by = [s[i].item() + (0.0 if bias is None else bias[i].item()) for i in range(n)]
            chosen.append(set(sorted(range(n), key=lambda i: -by[i])[:k]))
        f = [n / (k * length) * sum(i in c for c in chosen) for i in range(n)]
        p = [sum(s[i] / sum(s) for s in scores) / length for i in range(n)]
        total = total + sum(f[i] * p[i] for i in range(n))
    return total


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "selection_bias"])
def test_the_sigmoid_auxiliary_loss_is_k_times_deepseek_v3s_sequence_wise_loss(bias):
    """Ours, per sequence and layer, is E x sum_e (slots to e / tokens) x (mean normalized score of e): DeepSeek-V3's
    L_Bal at alpha 1 times k, value and router gradient (so moe.aux_loss_coeff = alpha / k). Its f counts each
    token's top k of the scores alone, as the paper writes it, also where the selection bias (moe.load_balance_coeff)
    chose other experts (checked apart: the bias here moves some tokens' choice)."""
    args = MoEArgs(num_experts=6, top_k=2, score_func="sigmoid", aux_loss_coeff=0.5,
                   load_balance_coeff=1e-3 if bias else 0.0)
    m = layer(args)
    if bias:
        m.router.expert_bias.copy_(torch.tensor([0.02, -0.01, 0.0, 0.03, -0.02, -0.02]))
    x = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(11))
    grad, ours = aux_gradient(m, x), m.aux_sum.item()  # aux_scale 1: the sum over the 3 sequences
    gate = m.router.gate.weight.detach().double().requires_grad_()
    reference = deepseek_balance_loss(gate, None, x, 2)
    (0.5 * 2 * reference).backward()
    assert abs(ours - 2 * reference.item()) <= 1e-6 * ours, (ours, 2 * reference.item())
    torch.testing.assert_close(grad, gate.grad.float(), rtol=1e-5, atol=1e-8)
    if bias:  # an f of the experts the bias chose gives another figure (3.6e-4 away): the bias moved choices
        routed = deepseek_balance_loss(gate.detach(), m.router.expert_bias, x, 2).item()
        assert abs(ours - 2 * routed) > 1e-4 * ours


# A power of two: scaling the loss by it scales every gradient exactly, so the scaled step's are S x the plain step's
# to the bit.
S = 2.0**10


def moe_step(scale) -> Step:
    """tiny_moe (2 MoE blocks of 8 experts, top 2) with both router losses on, as a Step with loss scaling `scale`."""
    args = FLAVORS["tiny_moe"].with_(vocab_size=258, max_seq_len=16)
    model = Transformer(args.with_(moe=replace(args.moe, aux_loss_coeff=0.3, router_z_loss=0.01)))
    model.init_weights(seed=0)
    return Step(model, torch.device("cpu"), FP32, scale=scale)


def router_grads(scale) -> dict[str, torch.Tensor]:
    step = moe_step(scale)
    step.train_step([batch(2, 0)], 32)
    return {n: p.grad.clone() for n, p in step.model.named_parameters() if "router" in n}


def test_a_scaled_loss_gives_the_router_losses_the_scale_as_their_gradient(monkeypatch):
    """The step gives the router losses (trained through WithLoss, beside the model's loss) the loss scale as their
    gradient, as backward gives the scaled loss: the router's gradients are S x the unscaled step's to the bit, as
    precision.UpdateGuard.unscale_ expects of every gradient. Given 1 instead, they are not."""
    plain, scaled = router_grads(lambda loss: loss), router_grads(lambda loss: loss * S)
    assert len(plain) == 2
    for name, g in plain.items():
        assert g.abs().sum() > 0 and torch.equal(scaled[name], S * g), name
    apply = moe.WithLoss.apply
    monkeypatch.setattr(moe.WithLoss, "apply", lambda x, aux, seed: apply(x, aux, 1.0))
    unseeded = router_grads(lambda loss: loss * S)
    assert all(not torch.allclose(unseeded[name], S * g, rtol=1e-3) for name, g in plain.items())


# The fp16 run's auxiliary loss at weight 1 (the flavor's is 0.02): its gradient then holds a share of the router's,
# and of the step's grad norm, that fp16's rounding does not hide. Measured 2026-12-06, the scale lost from its
# gradient: the step-1 grad norm 1.6e-2 from fp32's (relative), the step-2 aux_loss 3.6e-3, the routers 1.35x their
# movement; kept: 1.6e-5, 1e-6 and 7e-4x (4e-5, 1.8e-4 and 0.31x with the gate computed in fp16).
ROUTED = ("--model.flavor", "tiny_moe", "--training.steps", "2", "--training.seq_len", "16",
          "--moe.aux_loss_coeff", "1")


def test_an_fp16_run_trains_the_auxiliary_loss_as_the_fp32_run_does(tmp_path):
    """fp16 scales the loss by 2^16 and divides every gradient by it before the update: an auxiliary loss whose
    gradient missed the scale would be trained 2^16 times too weakly. Against the fp32 run of the same config: the
    grad norm of step 1 (the same weights), the auxiliary loss of step 2 (after one update) and the routers' weights
    after step 2, each within fp16's rounding of fp32's."""
    runs = {}
    for name, dtype in [("fp32", "float32"), ("fp16", "float16")]:
        train_in_process(tmp_path / name, *ROUTED, "--training.mixed_precision_param", dtype, "--checkpoint.enable",
                         "--checkpoint.interval", "2")
        runs[name] = read_metrics(tmp_path / name), read_tensors(str(tmp_path / name / "checkpoint" / "step-2"))
    (ref, ref_weights), (half, weights) = runs["fp32"], runs["fp16"]
    assert half[-1]["loss_scale"] == 2.0**16 and half[-1]["skipped_steps"] == 0
    assert abs(half[0]["grad_norm"] - ref[0]["grad_norm"]) <= 1e-3 * ref[0]["grad_norm"]
    assert abs(half[1]["aux_loss"] - ref[1]["aux_loss"]) <= 1e-3 * ref[1]["aux_loss"]
    cfg = load_config(["--job.config_file", str(TINY), *ROUTED])
    initial = Transformer(registry.get(cfg.model.name).run_args(cfg, 258))
    initial.init_weights(seed=cfg.training.seed)
    for name, w in initial.named_parameters():
        if "router" in name:
            moved = (ref_weights[f"model.{name}"] - w).norm()
            assert 0 < moved < 0.2 * w.norm(), name  # the run's initial weights: two steps move them a little
            assert (weights[f"model.{name}"] - ref_weights[f"model.{name}"]).norm() <= 0.5 * moved, name


# tiny_moe's auxiliary loss, the router z-loss and DeepSeek-V3's bias, validated after every step, saved at step 2
BALANCED = ("--model.flavor", "tiny_moe", "--training.steps", "2", "--training.seq_len", "16",
            "--training.mixed_precision_param", "bfloat16", "--moe.router_z_loss", "1e-2", "--moe.load_balance_coeff",
            "1e-2", "--validation.enable", "--validation.freq", "1", "--validation.steps", "1", "--checkpoint.enable",
            "--checkpoint.interval", "2")


@pytest.fixture(scope="module")
def eager_balanced(tmp_path_factory):
    """The eager run the compiled ones must give, its gradients at step 1 recorded."""
    out = tmp_path_factory.mktemp("eager_balanced")
    with recording(out):
        train_in_process(out, *BALANCED)
    return out


@pytest.mark.parametrize("ac", ["none", "full"])
def test_compiled_blocks_count_and_balance_as_eager_ones_bit_for_bit(tmp_path, ac, eager_balanced):
    """A compiled block (one graph, aot_eager: eager's ops) trains the auxiliary loss and the router z-loss and counts
    its slots as an eager one: once per training forward, not in checkpointing's recompute (in the compiled backward
    graph) nor in validation (run here after every step). Every step's routed_slots is the global batch's tokens x top
    k x MoE layers; the losses, load and gradients are the eager run's bits, and so is the bias after 2 updates."""
    with recording(tmp_path):
        train_in_process(tmp_path, *BALANCED, "--compile.enable", "--compile.backend", "aot_eager",
                         "--activation_checkpoint.mode", ac)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records if "val_loss" in r] == [1, 2]
    for r in records:
        assert r["routed_slots"] == 2 * 16 * 2 * 2 and r["aux_loss"] > 0 and r["router_z_loss"] > 0, r
        loads = [v for key, v in r.items() if key.startswith("expert_load/")]
        assert len(loads) == 2 and all(math.isfinite(v) and v >= 1 for v in loads), r
    numbers = lambda folder: [{k: v for k, v in r.items() if k.startswith(NUMBERS)}  # noqa: E731
                              for r in read_metrics(folder) if "loss" in r]
    assert numbers(tmp_path) == numbers(eager_balanced)
    grads, ref = load_grads(tmp_path), load_grads(eager_balanced)
    assert grads.keys() == ref.keys() and all(torch.equal(grads[n], ref[n]) for n in ref)
    bias = {k: v for k, v in read_tensors(str(tmp_path / "checkpoint" / "step-2")).items() if "expert_bias" in k}
    ref_bias = read_tensors(str(eager_balanced / "checkpoint" / "step-2"))
    assert len(bias) == 2 and all(b.abs().sum() > 0 and torch.equal(b, ref_bias[k]) for k, b in bias.items())
