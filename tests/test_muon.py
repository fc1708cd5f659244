"""Muon (training/muon.py) against torch.optim.Muon, its independent reference: the same Newton-Schulz iteration and
lr adjustments, and the same steps bit for bit where ours runs the iteration in torch's bf16; the AdamW part as
AdamW alone; a skipped step changes nothing; the model's matrices (the spec's param_group) are the ones it takes.
That a sharded run orthogonalizes whole matrices: tests/multiprocess/test_muon.py."""

import pytest
import torch
import torch.optim._muon as torch_muon

from tests.multiprocess.launch import train_in_process
from torchtitan_lite.config import JobConfig, load_config
from torchtitan_lite.models import registry
from torchtitan_lite.models.init import canonical_name
from torchtitan_lite.training.muon import NS_COEFFICIENTS, NS_STEPS, Muon, adjusted_lr, zeropower
from torchtitan_lite.training.optim import AdamW
from torchtitan_lite.training.optimizers import build_optimizer
from torchtitan_lite.runtime.precision import UpdateGuard
from torchtitan_lite.training.update import Update

SETTINGS = {"muon": True, "momentum": 0.95, "nesterov": True, "ns_steps": NS_STEPS, "ns_coefficients": NS_COEFFICIENTS,
            "ns_eps": 1e-7, "ns_dtype": torch.bfloat16, "adjust_lr": "match_rms_adamw"}


@pytest.mark.parametrize("shape", [(64, 64), (48, 96), (96, 48)], ids=["square", "wide", "tall"])
def test_the_orthogonalization_is_torchs_in_bf16_and_orthogonalizes_in_fp32(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    theirs = torch_muon._zeropower_via_newtonschulz(g, NS_COEFFICIENTS, NS_STEPS, 1e-7)
    assert torch.equal(zeropower(g, dtype=torch.bfloat16), theirs.float())
    # fp32: the singular values land in the quintic's band around 1 (Keller Jordan's ~(0.7, 1.2)), as an SVD shows,
    # but for the few too small for 5 steps to lift (a random square matrix has some near 0)
    singular = torch.linalg.svdvals(zeropower(g))
    assert (singular > 0.6).float().mean() > 0.9 and singular.max() < 1.3
    assert zeropower(g).is_contiguous()  # a collective reads it in storage order (muon.py)


@pytest.mark.parametrize("rule", ["original", "match_rms_adamw"])
def test_the_lr_adjustments_are_torchs(rule):
    for shape in ((64, 64), (48, 96), (96, 48)):
        assert adjusted_lr(0.02, rule, shape) == torch_muon._adjust_lr(0.02, rule, torch.Size(shape))


@pytest.mark.parametrize("nesterov", [True, False])
def test_three_steps_are_torchs_bit_for_bit(nesterov):
    gen = torch.Generator().manual_seed(1)
    ours = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in ((32, 32), (24, 48), (48, 24))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    mine = Muon([{"params": ours, **SETTINGS, "nesterov": nesterov}], lr=0.02, weight_decay=0.1)
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        mine.step()
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert all(torch.equal(mine.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"])
               for a, b in zip(ours, theirs))


def test_the_other_groups_step_as_adamw_alone_and_a_skipped_step_changes_nothing():
    gen = torch.Generator().manual_seed(2)
    matrix, norm = torch.nn.Parameter(torch.randn(16, 16, generator=gen)), torch.nn.Parameter(torch.ones(16))
    alone = torch.nn.Parameter(norm.detach().clone())
    mine = Muon([{"params": [norm], "muon": False}, {"params": [matrix], **SETTINGS}], lr=0.01, fused=True)
    adamw = AdamW([alone], lr=0.01, fused=True)
    for skip in (0.0, 1.0, 0.0):
        matrix.grad, norm.grad = torch.randn(16, 16, generator=gen), torch.randn(16, generator=gen)
        alone.grad = norm.grad.clone()
        before = matrix.detach().clone(), mine.state[matrix].get("momentum_buffer", torch.zeros(1)).clone()
        for opt in (mine, adamw):  # as runtime/precision.apply_or_skip hands a fused optimizer its skip
            opt.found_inf, opt.grad_scale = torch.tensor(skip), None
            opt.step()
            del opt.found_inf, opt.grad_scale
        assert torch.equal(norm, alone)
        if skip:
            assert torch.equal(matrix, before[0]) and torch.equal(mine.state[matrix]["momentum_buffer"], before[1])
        else:
            assert not torch.equal(matrix, before[0])


def test_under_fp16_loss_scaling_muon_steps_on_the_true_gradients_and_skips_an_overflow():
    """The trainer's update (training/update.py) with fp16's scaler: gradients scaled by 2^16, unscaled before the
    step, so Muon's matrices and AdamW's rest take the fp32 run's steps bit for bit (the scales are powers of 2); an
    overflowing step is skipped by both groups and halves the scale."""
    def run(dtype: torch.dtype, grads: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], UpdateGuard]:
        gen = torch.Generator().manual_seed(4)
        params = [torch.nn.Parameter(torch.randn(16, 24, generator=gen)), torch.nn.Parameter(torch.ones(16))]
        opt = Muon([{"params": params[1:], "muon": False}, {"params": params[:1], **SETTINGS}], lr=0.01, fused=True)
        guard = UpdateGuard(torch.device("cpu"), dtype)
        update = Update(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), guard,
                        lambda: torch.nn.utils.clip_grad_norm_(params, 1e9))
        for step, gs in enumerate(grads, 1):
            for p, g in zip(params, gs):
                p.grad = g * (guard.scaler.scale if guard.enabled else 1)
            update(step)
        return params, guard

    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(16, 24, generator=gen), torch.randn(16, generator=gen)] for _ in range(3)]
    overflow = [torch.full((16, 24), float("inf")), grads[1][1]]
    fp16, guard = run(torch.float16, [grads[0], overflow, grads[1], grads[2]])
    fp32, _ = run(torch.float32, grads)
    assert all(torch.equal(a, b) for a, b in zip(fp16, fp32))
    assert guard.scaler.scale.item() == 2.0**15 and guard.skipped.item() == 1


@pytest.mark.parametrize("flavor", ["tiny", "tiny_moe"])
def test_muon_takes_the_specs_matrices_and_adamw_the_rest(flavor):
    cfg = load_config(["--optimizer.name", "Muon", "--model.flavor", flavor, "--muon.adamw_lr", "3e-4"])
    spec = registry.get("llama3")
    model = spec.model_class(spec.args(flavor, 64, 16))
    optimizer = build_optimizer(model, cfg, "cpu", spec.param_group)
    names = {p: canonical_name(n) for n, p in model.named_parameters()}
    rest, matrices = ([names[p] for p in g["params"]] for g in optimizer.param_groups)
    assert [g["lr"] for g in optimizer.param_groups] == [3e-4, cfg.optimizer.lr]
    assert all(names[p] in matrices or names[p] in rest for p in names) and not set(matrices) & set(rest)
    assert "layers.0.attention.wo.weight" in matrices and "tok_embeddings.weight" in rest and "output.weight" in rest
    assert not any("norm" in n for n in matrices)
    if flavor == "tiny_moe":
        assert "layers.0.moe.experts.w2" in matrices and "layers.0.moe.router.gate.weight" in rest


def test_an_unknown_optimizer_or_one_muon_cannot_run_with_is_one_line(error_line, monkeypatch):
    assert error_line(1, ["--optimizer.name", "muon"]) == (
        "error: optimizer.name 'muon' is not a registered optimizer: choose one of AdamW, Muon; did you mean Muon?")
    assert "Muon with fault_tolerance.enable" in error_line(1, ["--optimizer.name", "Muon",
                                                                "--fault_tolerance.enable"])
    spec = registry.get("llama3")
    monkeypatch.setitem(registry.SPECS, "plain", type(spec)("plain", spec.model_class, spec.flavors, spec.tp_plan,
                                                            spec.tp_sizes, spec.flops_per_token))
    assert "model plain's spec does not say (param_group): use AdamW" in error_line(
        1, ["--optimizer.name", "Muon", "--model.name", "plain"])
    assert JobConfig().optimizer.name == "AdamW"  # the default, whose curve the reference test holds


def test_a_resumed_muon_continues_bit_for_bit():
    """Its state (each matrix's momentum and step count, the AdamW groups' moments) saves and loads: two steps, a
    state dict, two more in a new optimizer give the four straight steps' weights."""
    def run(resume_after: int | None) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(16, 24, generator=gen)), torch.nn.Parameter(torch.ones(16))]
        grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(4)]
        def make():
            return Muon([{"params": params[1:], "muon": False}, {"params": params[:1], **SETTINGS}], lr=0.01)
        opt = make()
        for step, gs in enumerate(grads):
            if step == resume_after:
                saved, opt = opt.state_dict(), make()
                opt.load_state_dict(saved)
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        return params

    assert all(torch.equal(a, b) for a, b in zip(run(None), run(2)))


@pytest.mark.parametrize("first, then", [("AdamW", "Muon"), ("Muon", "AdamW")])
def test_a_checkpoint_of_the_other_optimizer_is_one_line_naming_both(tmp_path, first, then):
    saving = ("--checkpoint.enable", "--checkpoint.interval", "1")
    train_in_process(tmp_path, *saving, "--training.steps", "1", "--optimizer.name", first)
    run = train_in_process(tmp_path, *saving, "--training.steps", "2", "--optimizer.name", then, check=False)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {tmp_path / 'checkpoint' / 'step-1'} holds {first}'s state and this run's optimizer.name "
        f"is {then}: resume with optimizer.name {first}, or start from its weights alone "
        "(checkpoint.initial_load_path with checkpoint.initial_load_model_only)")
