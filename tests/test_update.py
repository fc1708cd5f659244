"""The update (training/update.py): any voter skips a step, on the device, without touching the non-finite guard's
counts; hooks follow every update, skipped or not, and the first-step hooks the first alone."""

import torch

from torchtitan_lite.runtime.precision import UpdateGuard
from torchtitan_lite.tools.sync_count import SyncRecorder
from torchtitan_lite.training.update import Update


def update_of(p: torch.nn.Parameter) -> Update:
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (step + 1))
    return Update(opt, schedule, UpdateGuard(torch.device("cpu"), torch.float32, skip_nonfinite=1),
                  lambda: torch.linalg.vector_norm(p.grad))


def test_a_second_voter_skips_the_step_on_the_device_and_the_hooks_run_all_the_same():
    p = torch.nn.Parameter(torch.ones(3))
    update, calls = update_of(p), []
    update.votes.append(lambda grad_norm, step: torch.tensor(step == 2))  # another reason to skip: step 2's
    update.after_step.append(lambda: calls.append("every"))
    update.after_first_step.append(lambda: calls.append("first"))
    weights = []
    for step in (1, 2, 3):
        (p * 2).sum().backward()
        with SyncRecorder() as recorder:
            update(step)
        assert not recorder.syncs, f"step {step}: {dict(recorder.syncs)}"
        assert p.grad is None  # freed
        weights.append(p.detach().clone())
    assert not torch.equal(weights[0], torch.ones(3)) and torch.equal(weights[1], weights[0])  # 2 skipped
    assert not torch.equal(weights[2], weights[1])
    assert calls == ["every", "first", "every", "every"]
    assert update.guard.metrics() == {"skipped_steps": 0}  # not the guard's skip: finite gradients
    assert update.fields() == {"lr": 0.1 / 3}  # the rate step 3 used; the schedule has moved on since


def test_the_guard_votes_alone_when_no_other_voter_is_registered():
    p = torch.nn.Parameter(torch.ones(3))
    update = update_of(p)
    p.grad = torch.full((3,), float("nan"))
    update(1)
    assert torch.equal(p.detach(), torch.ones(3))
    assert update.guard.metrics() == {"skipped_steps": 1}
