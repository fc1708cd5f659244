"""The update guard: fp16's loss scaling skips overflowed steps (counting them), keeps GradScaler's scale rules and
state, stops at its floor, and carries its scale across a resume; in other precisions a non-finite step stops the run
before the update, or is skipped when allowed."""

from unittest import mock

import pytest
import torch

from torchtitan_lite.runtime.precision import LossScaler, NonFiniteError, UpdateGuard, apply_or_skip, moved
from torchtitan_lite.tools.sync_count import SyncRecorder


def step(guard: UpdateGuard, grad: float, n: int = 1) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    guard.scale(p.sum()).backward()
    p.grad.fill_(grad * guard.scale(torch.tensor(1.0)).item())  # what backward of a loss with this gradient gives
    guard.unscale_(opt)
    apply_or_skip(opt, guard.vote(p.grad.norm(), n))
    return p


def test_fp16_skips_overflowed_steps_and_resumes_its_scale():
    guard = UpdateGuard(torch.device("cpu"), torch.float16)
    assert guard.scale(torch.tensor(1.0)).item() == 2.0**16
    assert step(guard, 1.0).tolist() == [0.5, 0.5]  # unscaled before the step: the update used the true gradient
    assert step(guard, float("inf")).tolist() == [1.0, 1.0]  # skipped, the run goes on
    assert guard.metrics() == {"loss_scale": 2.0**15, "skipped_steps": 1}
    resumed = UpdateGuard(torch.device("cpu"), torch.float16)
    resumed.load_state_dict(guard.state_dict())
    assert resumed.metrics() == guard.metrics()


def adamw_step(guard: UpdateGuard, opt: torch.optim.Optimizer, grad: float, n: int) -> None:
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.full_like(p, grad)
    apply_or_skip(opt, guard.vote(p.grad.norm(), n))


def state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    p = opt.param_groups[0]["params"][0]
    return [t.clone() for t in (p.detach(), *opt.state[p].values())]  # weights, step, exp_avg, exp_avg_sq


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_step_changes_nothing_and_stops_the_run_at_the_next_check(implementation, bad):
    """Fused AdamW skips on the device (found_inf): weights, moments and step count stay bitwise, and so do they at
    every later step until the host checks, which names the step."""
    guard = UpdateGuard(torch.device("cpu"), torch.bfloat16)
    assert guard.scale(torch.tensor(3.0)).item() == 3.0  # no loss scaling outside fp16
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, weight_decay=0.1,
                            fused=implementation == "fused", foreach=implementation == "foreach")
    adamw_step(guard, opt, 1.0, 1)
    guard.check()
    before = state(opt)
    adamw_step(guard, opt, bad, 2)
    adamw_step(guard, opt, 1.0, 3)  # finite, but the run has had to stop: no update either
    assert all(torch.equal(a, b) for a, b in zip(state(opt), before))
    with pytest.raises(NonFiniteError, match="step 2: the gradient norm is (nan|inf)"):
        guard.check()
    with pytest.raises(NonFiniteError, match="step 2"):
        guard.state_dict()  # a checkpoint save checks too: no state past the step is saved
    assert guard.metrics() == {}  # nothing counted


def test_nonfinite_steps_are_skipped_up_to_n_in_a_row():
    guard = UpdateGuard(torch.device("cpu"), torch.float32, skip_nonfinite=2)
    for n, grad in enumerate([float("nan"), float("inf"), 1.0, float("nan"), float("nan")], start=1):
        p = step(guard, grad, n)
        assert p.tolist() == ([0.5, 0.5] if grad == 1.0 else [1.0, 1.0])  # a skipped update leaves the weights
    guard.check()  # at most 2 in a row: the run goes on
    assert guard.metrics() == {"skipped_steps": 4}
    resumed = UpdateGuard(torch.device("cpu"), torch.float32, skip_nonfinite=2)
    resumed.load_state_dict(guard.state_dict())
    p = step(resumed, float("nan"), 6)  # the third in a row, across the resume
    assert p.tolist() == [1.0, 1.0]
    with pytest.raises(NonFiniteError, match="step 6: .*[(]3 such step"):
        resumed.check()


def test_the_loss_scale_follows_grad_scalers_rules_and_loads_its_state():
    """Backoff on overflow, growth after growth_interval good steps, bitwise GradScaler's; its checkpointed state
    (the keys an older run saved) loads."""
    ours, theirs = LossScaler(torch.device("cpu")), torch.amp.GradScaler("cpu", growth_interval=3)
    ours.growth_interval = 3
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    for overflow in [False, False, False, True, False, True, True, False, False, False, False, False, False]:
        theirs.scale(p.sum()).backward()
        p.grad.fill_(float("inf") if overflow else 1.0)
        theirs.step(opt)
        theirs.update()
        opt.zero_grad()
        ours.update(torch.tensor(overflow))
        assert (ours.scale.item(), ours.growth_tracker.item()) == (theirs.get_scale(), theirs._get_growth_tracker())
    assert ours.scale.item() == 2.0**16  # went down and back up
    assert ours.state_dict() == theirs.state_dict()
    guard = UpdateGuard(torch.device("cpu"), torch.float16)
    guard.load_state_dict({**theirs.state_dict(), "skipped_steps": 3, "in_a_row": 0})
    assert guard.metrics() == {"loss_scale": 2.0**16, "skipped_steps": 3}
    assert guard.scaler.growth_interval == 3


@pytest.mark.parametrize("skip_nonfinite", [0, 1])
def test_fp16_overflow_at_the_lowest_scale_counts_as_a_nonfinite_step(skip_nonfinite):
    """Above the floor an overflow only halves the scale; at 1.0 it stops the run (or is skipped up to N in a row),
    and the scale never falls below 1.0."""
    guard = UpdateGuard(torch.device("cpu"), torch.float16, skip_nonfinite=skip_nonfinite)
    guard.scaler.scale.fill_(4.0)
    inf = float("inf")
    for n, grad in enumerate([inf, inf, inf, 1.0, inf, inf], start=1):
        p = step(guard, grad, n)
        assert p.tolist() == ([0.5, 0.5] if grad == 1.0 and n == 4 and skip_nonfinite else [1.0, 1.0])
        assert guard.scaler.scale.item() == max(4.0 / 2**n, 1.0)
        if n == 2:
            guard.check()  # scale 4 -> 2 -> 1: routine
    stop = 3 if skip_nonfinite == 0 else 6  # the first (N+1)-th overflow in a row at the floor
    with pytest.raises(NonFiniteError, match=f"step {stop}: the gradient norm is inf at fp16's lowest loss scale 1.0"):
        guard.check()


def test_the_decision_reaches_the_host_by_a_blocking_copy():
    """Under CPU offload fused AdamW runs on the host: its found_inf must be a completed copy of the device's flag
    (fused AdamW's own copy is non-blocking)."""
    flag = mock.Mock(device=torch.device("cuda", 0))
    moved(flag, torch.device("cpu"))
    flag.to.assert_called_once_with(torch.device("cpu"), non_blocking=False)
    same = torch.zeros(())
    assert moved(same, torch.device("cpu")) is same  # no copy when the optimizer lives with the flag


def test_an_fp16_step_with_fused_adamw_never_waits_for_the_device():
    guard = UpdateGuard(torch.device("cpu"), torch.float16)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    for n, grad in enumerate([1.0, float("inf"), 1.0], start=1):
        with SyncRecorder() as recorder:
            guard.scale((p * grad).sum()).backward()
            guard.unscale_(opt)
            apply_or_skip(opt, guard.vote(torch.linalg.vector_norm(p.grad), n))
            opt.zero_grad()
        assert not recorder.syncs, f"step {n}: {dict(recorder.syncs)}"
    assert guard.metrics() == {"loss_scale": 2.0**15, "skipped_steps": 1}
