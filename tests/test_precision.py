"""The update guard: fp16's loss scaling skips overflowed steps (counting them) and carries its scale across a
resume; in other precisions a non-finite step stops the run before the update, or is skipped when allowed."""

import pytest
import torch

from torchtitan_lite.precision import NonFiniteError, UpdateGuard


def step(guard: UpdateGuard, grad: float, n: int = 1) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    guard.scale(p.sum()).backward()
    p.grad.fill_(grad * guard.scaler.get_scale())  # what backward of a loss with this gradient gives, scaled
    guard.unscale_(opt)
    guard.step(opt, p.grad.norm(), n)
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
    guard.step(opt, p.grad.norm(), n)


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
