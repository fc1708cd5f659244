"""step.py: the one step the loop, validation and the memory estimator run; micro-batches add up to the big batch."""

import torch

from torchtitan_lite.training import step as step_module
from torchtitan_lite.config import load_config
from torchtitan_lite.tools.memory import estimate_memory
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
from torchtitan_lite.training.step import Numerics, Step

FP32 = Numerics(torch.float32, autocast=False, loss_parallel=False)
TINY = ["--job.config_file", "tests/assets/tiny.toml"]


def tiny_step() -> Step:
    args = FLAVORS["debugmodel"].with_(dim=64, n_layers=2, n_heads=4, multiple_of=32, vocab_size=258, max_seq_len=16)
    model = Transformer(args)
    model.init_weights(seed=0)
    return Step(model, torch.device("cpu"), FP32)


def batch(rows: int, seed: int):
    tokens = torch.randint(0, 258, (rows, 17), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def grads(step: Step) -> list[torch.Tensor]:
    return [p.grad.clone() for p in step.model.parameters()]


def test_micro_batches_give_the_loss_and_gradient_of_the_one_big_batch():
    (a_in, a_lab), (b_in, b_lab) = batch(2, 0), batch(2, 1)
    tokens = 4 * 16  # the step's global token count: both micro-batches
    accumulated, whole = tiny_step(), tiny_step()
    loss = accumulated.train_step([(a_in, a_lab), (b_in, b_lab)], tokens)
    big = whole.train_step([(torch.cat([a_in, b_in]), torch.cat([a_lab, b_lab]))], tokens)
    torch.testing.assert_close(loss, big)
    for g, h in zip(grads(accumulated), grads(whole)):
        torch.testing.assert_close(g, h)


def test_eval_step_measures_the_train_steps_loss_without_gradients():
    step, micro_batches = tiny_step(), [batch(2, 0), batch(2, 1)]
    evaluated = step.eval_step(iter(micro_batches), 64)  # validation hands it a generator
    assert all(p.grad is None for p in step.model.parameters())
    torch.testing.assert_close(evaluated, step.train_step(micro_batches, 64))


def test_the_memory_estimate_runs_the_trainers_step_and_its_loss(monkeypatch):
    """The estimator's loss is the trainer's: summed token losses over the global token count (2 ranks x 2 x 64)."""
    seen = []

    def recording_token_loss(logits, labels, tokens, *blocks):
        seen.append(tokens)
        return token_loss(logits, labels, tokens, *blocks)

    token_loss = step_module.token_loss
    monkeypatch.setattr(step_module, "token_loss", recording_token_loss)
    estimate_memory(load_config(TINY), 2)
    assert seen == [2 * 2 * 64] * 2  # its two steps
