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


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_step_stops_the_run_before_the_update(bad):
    guard = UpdateGuard(torch.device("cpu"), torch.bfloat16)
    assert guard.scale(torch.tensor(3.0)).item() == 3.0  # no loss scaling outside fp16
    assert step(guard, 1.0).tolist() == [0.5, 0.5]
    with pytest.raises(NonFiniteError, match="step 7: the gradient norm is (nan|inf)"):
        step(guard, bad, n=7)
    assert guard.metrics() == {} and guard.state_dict() == {}  # nothing counted, nothing saved


def test_nonfinite_steps_are_skipped_up_to_n_in_a_row():
    guard = UpdateGuard(torch.device("cpu"), torch.float32, skip_nonfinite=2)
    for n, grad in enumerate([float("nan"), float("inf"), 1.0, float("nan"), float("nan")], start=1):
        p = step(guard, grad, n)
        assert p.tolist() == ([0.5, 0.5] if grad == 1.0 else [1.0, 1.0])  # a skipped update leaves the weights
    assert guard.metrics() == {"skipped_steps": 4}
    resumed = UpdateGuard(torch.device("cpu"), torch.float32, skip_nonfinite=2)
    resumed.load_state_dict(guard.state_dict())
    with pytest.raises(NonFiniteError, match="step 6: .*[(]3 such step"):  # the third in a row, across the resume
        step(resumed, float("nan"), 6)
