import logging
import math

import pytest
import torch

from torchtitan_lite.config import JobConfig, LRScheduler, Optimizer
from torchtitan_lite.training.optim import build_lr_scheduler, clip_grad_norm_, lr_factor
from torchtitan_lite.training.optimizers import build_optimizer


def factors(steps, **kw):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = build_lr_scheduler(opt, LRScheduler(**kw), steps)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_warmup_then_linear_decay_over_all_remaining_steps():
    f = factors(10, warmup_steps=2, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)
    assert f[:2] == [0.5, 1.0]
    assert f[2:] == pytest.approx([1 - i / 8 for i in range(8)])


def test_stable_phase_then_decay_to_min():
    f = factors(10, warmup_steps=2, decay_ratio=0.4, decay_type="linear", min_lr_factor=0.1)
    assert f[2:6] == [1.0] * 4
    assert f[6:] == pytest.approx([0.1 + 0.9 * (1 - i / 4) for i in range(4)])


def test_no_decay():
    assert factors(6, warmup_steps=1, decay_ratio=0.0)[1:] == [1.0] * 5


@pytest.mark.parametrize("kind,shape", [("sqrt", lambda p: 1 - math.sqrt(p)),
                                        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p)))])
def test_decay_shapes(kind, shape):
    for step in range(4, 10):
        p = (step - 4) / 6
        assert lr_factor(step, 4, 6, 10, kind, 0.0) == pytest.approx(shape(p))


def torchtitan_factor(n, warmup, decay_ratio, total, kind, min_factor):
    """torchtitan's warmup-stable-decay factor after n optimizer steps (its torchtitan/components/lr_scheduler.py since
    pytorch/torchtitan#1284), restated. The stable phase holds one virtual step past the end, so the lr reaches
    min_factor only once the last step has trained."""
    warmup = min(warmup, total)
    decay = total - warmup if decay_ratio is None else min(round(total * decay_ratio), total - warmup)
    stable = total + 1 - warmup - decay
    if n < warmup:
        return (n + 1) / warmup
    if n < warmup + stable:
        return 1.0
    progress = (n + 1 - warmup - stable) / decay
    shape = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress),
             "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[kind]
    return min_factor + (1 - min_factor) * shape


@pytest.mark.parametrize("warmup,decay_ratio,steps,kind,min_factor", [
    (2, 0.8, 20, "linear", 0.0),  # the debug config
    (2, None, 10, "linear", 0.0), (0, None, 7, "cosine", 0.1), (0, 0.5, 9, "sqrt", 0.2),
    (3, 0.4, 20, "cosine", 0.0), (5, 0.8, 10, "linear", 0.1),  # warmup + decay > steps: decay shortened
    (10, None, 5, "linear", 0.0), (2, 0.0, 6, "linear", 0.5), (1, 1 / 3, 13, "sqrt", 1 / 3),
    (4, 0.1, 10, "linear", 0.0)])
def test_schedule_is_torchtitans_step_for_step(warmup, decay_ratio, steps, kind, min_factor):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=warmup, decay_ratio=decay_ratio, decay_type=kind,
                                                 min_lr_factor=min_factor), steps)
    ours = [sched.get_last_lr()[0]]
    for _ in range(steps):  # the lr of each step, then the one left once they are done
        opt.step()
        sched.step()
        ours.append(sched.get_last_lr()[0])
    assert ours == [torchtitan_factor(n, warmup, decay_ratio, steps, kind, min_factor) for n in range(steps + 1)]
    decays = (decay_ratio is None or round(decay_ratio * steps) > 0) and warmup < steps
    if decays:
        assert ours[-1] == min_factor  # the decay ends at min_lr_factor, right after the last step
        assert ours[-2] > min_factor or min_factor == 1  # which itself trains one decay step above it


TINY = dict(warmup_steps=2, decay_ratio=0.5)  # tests/assets/tiny.toml's schedule


def resumed(at, steps, new_steps, new_lr=1.0, old_checkpoint=False, **kw):
    """The lr of each step after step `at` of a `steps`-step run (lr 1), resumed from its state there with
    `new_steps` and `new_lr`, the optimizer loaded first as checkpoint/manager.py does; `old_checkpoint`: saved
    before the settings were."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = build_lr_scheduler(opt, LRScheduler(**kw), steps)
    for _ in range(at):
        opt.step()
        sched.step()
    saved = sched.state_dict()
    if old_checkpoint:
        saved.pop("settings", None)
    opt2 = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=new_lr)
    sched2 = build_lr_scheduler(opt2, LRScheduler(**kw), new_steps)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(saved)
    out = []
    for _ in range(new_steps - at):
        out.append(sched2.get_last_lr()[0])
        opt2.step()
        sched2.step()
    return out


@pytest.mark.parametrize("old_checkpoint", [False, True])
def test_an_extended_run_follows_the_new_schedule_from_its_first_step(old_checkpoint, caplog):
    caplog.set_level(logging.INFO, logger="torchtitan_lite")
    assert resumed(4, 4, 6, old_checkpoint=old_checkpoint, **TINY) == factors(6, **TINY)[4:]
    doubled = [2 * f for f in factors(6, **TINY)[4:]]
    assert resumed(4, 4, 6, new_lr=2.0, old_checkpoint=old_checkpoint, **TINY) == doubled
    said = [r.getMessage() for r in caplog.records if "lr schedule changed" in r.getMessage()]
    assert said[-1] == ("the lr schedule changed since the checkpoint (lr 0 -> 1.33333): the lr of step 5 follows the "
                        "new schedule" if old_checkpoint else "the lr schedule changed since the checkpoint "
                        "(training.steps 4 -> 6, optimizer.lr 1.0 -> 2.0): the lr of step 5 follows the new schedule")


def test_an_unchanged_schedule_resumes_as_it_was(caplog):
    caplog.set_level(logging.INFO, logger="torchtitan_lite")
    assert resumed(4, 8, 8, **TINY) == factors(8, **TINY)[4:]
    cosine = dict(warmup_steps=3, decay_type="cosine", min_lr_factor=0.1)
    assert resumed(5, 9, 9, **cosine) == factors(9, **cosine)[5:]
    assert not [r for r in caplog.records if "lr schedule changed" in r.getMessage()]


def adamw(model, **settings):
    return build_optimizer(model, JobConfig(optimizer=Optimizer(**settings)), "cpu")


def stepped(model, **settings):
    opt = adamw(model, **settings)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return opt


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_a_resume_trains_with_the_configs_optimizer_settings(implementation, caplog):
    # torch's load_state_dict would take betas, eps, weight decay and kernel from the checkpoint: a cooldown resumed
    # with another weight decay would silently keep the old one. The lr is the schedule's (loaded after).
    caplog.set_level(logging.INFO, logger="torchtitan_lite")
    model = torch.nn.Linear(4, 3)
    saved = stepped(model, lr=0.5, weight_decay=0.1, implementation=implementation)
    new = dict(beta2=0.99, eps=1e-6, weight_decay=0.0, implementation="foreach" if implementation != "foreach" else
               "for-loop")
    resumed = adamw(model, lr=1.0, **new)
    resumed.load_state_dict(saved.state_dict())
    expected = adamw(model, lr=0.5, **new).param_groups[0]
    for key, value in resumed.param_groups[0].items():
        assert value == expected[key] or key == "params", key  # lr 0.5: the checkpoint's
    state = resumed.state[model.weight]
    assert torch.equal(state["exp_avg"], saved.state[model.weight]["exp_avg"]) and float(state["step"]) == 1
    model(torch.ones(2, 4)).sum().backward()
    resumed.step()  # the loaded step counters suit the new kernel
    said = [r.getMessage() for r in caplog.records if "optimizer's settings changed" in r.getMessage()]
    assert said == [f"the optimizer's settings changed since the checkpoint (optimizer.beta2 0.95 -> 0.99, "
                    f"optimizer.eps 1e-08 -> 1e-06, optimizer.weight_decay 0.1 -> 0.0, optimizer.implementation "
                    f"{implementation} -> {new['implementation']}): the resumed steps use the new ones"]
    caplog.clear()
    again = adamw(model, lr=0.5, weight_decay=0.1, implementation=implementation)
    again.load_state_dict(saved.state_dict())
    assert again.param_groups[0] == {**saved.param_groups[0], "params": again.param_groups[0]["params"]}
    assert not [r for r in caplog.records if "optimizer's settings changed" in r.getMessage()]


def test_clip_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    a = [torch.randn(5, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    b = [t.detach().clone().requires_grad_() for t in a]
    for x, y in zip(a, b):
        x.grad = torch.randn_like(x) * 3
        y.grad = x.grad.clone()
    ours = clip_grad_norm_(a, 1.0, world_size=1)
    theirs = torch.nn.utils.clip_grad_norm_(b, 1.0)
    assert torch.allclose(ours.float(), theirs)
    for x, y in zip(a, b):
        assert torch.allclose(x.grad, y.grad)
    norm_only = clip_grad_norm_(a, 0.0, world_size=1)
    assert torch.allclose(norm_only.float(), torch.tensor(1.0), atol=1e-5)


def test_norm_is_exact_on_large_gradients():
    """The norm that is logged and clipped by is the gradients' exact norm, however long a tensor: torch's float32
    CPU norm sums sequentially, off by ~1e-5 at 2M elements, which is more than two layouts' gradients differ."""
    torch.manual_seed(0)
    params = [torch.zeros(n, requires_grad=True) for n in (2_000_000, 525_000, 3)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    exact = sum(p.grad.double().square().sum() for p in params).sqrt().item()
    assert clip_grad_norm_(params, 0.0, world_size=1).item() == pytest.approx(exact, rel=1e-12, abs=0)


def test_an_uncounted_copy_is_clipped_but_not_counted():
    """A tied table's copy on the last pipeline stage (parallel/stage_ties.py): the norm counts the first stage's
    alone, and the copy takes the same clip factor, so both stages update alike."""
    torch.manual_seed(0)
    counted, copy = torch.zeros(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    counted.grad = torch.randn(4) * 3
    copy.grad = counted.grad.clone()
    expected = counted.grad.double().norm().item()
    norm = clip_grad_norm_([counted, copy], 1.0, world_size=1, uncounted=[copy])
    assert norm.item() == pytest.approx(expected, rel=1e-12)  # counted both: sqrt(2) times as much
    assert torch.equal(copy.grad, counted.grad) and counted.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
