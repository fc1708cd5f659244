"""fp16's loss scaler: scales, unscales, skips a step whose gradients overflowed (counting it), and carries its
state across a resume; in other precisions it passes everything through and saves nothing."""

import torch

from torchtitan_lite.precision import LossScaler


def step(scaler: LossScaler, grad: float) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler.scale(p.sum()).backward()
    p.grad.fill_(grad * scaler.scaler.get_scale())  # what backward of a loss with this gradient gives, scaled
    scaler.unscale_(opt)
    scaler.step(opt, p.grad.norm())
    return p


def test_fp16_skips_overflowed_steps_and_resumes_its_scale():
    scaler = LossScaler(torch.device("cpu"), torch.float16)
    assert scaler.scale(torch.tensor(1.0)).item() == 2.0**16
    p = step(scaler, 1.0)
    assert p.tolist() == [0.5, 0.5]  # unscaled before the step: the update used the true gradient
    p = step(scaler, float("inf"))
    assert p.tolist() == [1.0, 1.0]  # skipped
    assert scaler.metrics() == {"loss_scale": 2.0**15, "skipped_steps": 1}
    resumed = LossScaler(torch.device("cpu"), torch.float16)
    resumed.load_state_dict(scaler.state_dict())
    assert resumed.metrics() == scaler.metrics()


def test_other_precisions_pass_through():
    scaler = LossScaler(torch.device("cpu"), torch.bfloat16)
    assert scaler.scale(torch.tensor(3.0)).item() == 3.0
    assert step(scaler, float("inf")).isinf().all()  # not skipped: no loss scaling, nothing to skip
    assert scaler.metrics() == {} and scaler.state_dict() == {}
