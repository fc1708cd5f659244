"""training.z_loss (training/z_loss.py): PaLM's z-loss, trained beside the cross-entropy and logged apart, against
the formula written plainly; the router z-loss is tests/test_moe.py's. Under loss parallel and the other layouts:
tests/multiprocess/test_moe_layouts.py (the E6 runs train both)."""

import torch
import torch.nn.functional as F

from torchtitan_lite.training.step import Step
from torchtitan_lite.training.z_loss import ZLoss

from tests.test_step import batch, grads, tiny_step

WEIGHT = 0.05  # larger than PaLM's 1e-4, so that the term's share of each gradient is plain to see


def plain(step: Step, micro_batches, tokens: int, scale: float):
    """The loss, the z-loss and every gradient of `step`'s model by the formula: cross-entropy + WEIGHT x (1/tokens)
    sum over tokens of log(sum of exp(logits))^2, in float64, backward from `scale` times that."""
    model = step.model
    model.zero_grad()
    losses, zs = [], []
    for inputs, labels in micro_batches:
        logits = model(inputs).double()
        losses.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / tokens)
        zs.append((logits.exp().sum(-1).log() ** 2).sum() / tokens)
    loss, z = sum(losses), sum(zs)
    (scale * (loss + WEIGHT * z)).backward()
    return loss.item(), z.item(), grads(step)


def test_the_z_loss_trains_palms_formula_and_logs_it_apart_from_the_loss():
    """The step's loss is the cross-entropy alone (what every curve compares), its side sum PaLM's term before the
    weight, and every gradient that of loss + weight x z-loss, with fp16's loss scale on both (the term's gradient
    is the step's seed, as the MoE's auxiliary losses' is)."""
    micro_batches, tokens = [batch(2, 0), batch(2, 1)], 64
    for scale in (1.0, 8.0):
        step = tiny_step()
        step.z_loss, step.scale = ZLoss(WEIGHT), (lambda loss, s=scale: loss * s)
        loss = step.train_step(micro_batches, tokens)
        ours = grads(step)
        ref_loss, ref_z, ref_grads = plain(step, micro_batches, tokens, scale)
        assert abs(loss.item() - ref_loss) <= 1e-6 * ref_loss and abs(step.side_sums[0].item() - ref_z) <= 1e-6 * ref_z
        for got, want in zip(ours, ref_grads):
            torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-6)
        without = tiny_step()  # the same weights, no z-loss: the same loss, other gradients
        assert torch.equal(without.train_step(micro_batches, tokens), loss)
        assert (grads(without)[-1] - ours[-1] / scale).abs().max() > 1e-3  # the output's: the term is trained


def test_validation_measures_the_loss_without_the_z_loss():
    step = tiny_step()
    step.z_loss = ZLoss(WEIGHT)
    assert torch.equal(step.eval_step([batch(2, 0)], 32), tiny_step().eval_step([batch(2, 0)], 32))
    assert step.z_loss.values == []
