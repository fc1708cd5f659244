"""What a checkpoint saves besides the optimizer and the data: one Stateful per concern (checkpoint/manager.py puts
them together), each loadable on any mesh."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class TrainState(Stateful):
    """Progress outside the model and data: steps done, tokens seen, and training time so far, so a resumed run's
    logs continue where they stopped."""

    def __init__(self):
        self.step, self.tokens_seen = 0, 0
        self._elapsed_before, self._start = 0.0, time.perf_counter()

    def elapsed_s(self) -> float:
        return self._elapsed_before + time.perf_counter() - self._start

    def advance(self, tokens: int) -> None:
        """One more step done, of `tokens` tokens (the global batch's)."""
        self.step, self.tokens_seen = self.step + 1, self.tokens_seen + tokens

    def fields(self) -> dict[str, float]:
        return {"elapsed_s": self.elapsed_s(), "tokens_seen": self.tokens_seen}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed_s()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self._elapsed_before, self._start = float(state["elapsed_s"]), time.perf_counter()


class FnState(Stateful):
    """A Stateful made of its two functions."""

    def __init__(self, get: Callable[[], dict[str, Any]], set: Callable[[dict[str, Any]], None]):
        self.state_dict, self.load_state_dict = get, set


def model_state(model: torch.nn.Module, dtype: torch.dtype | None = None) -> FnState:
    # DTensor shards as they are, keyed by canonical parameter names: each rank saves what it holds, no gathering.
    def get():
        return {k: v.to(dtype) if dtype else v for k, v in get_model_state_dict(model).items()}
    return FnState(get, lambda state: set_model_state_dict(model, state))


def get_rng() -> dict[str, torch.Tensor]:
    # One copy, not one per rank: all ranks seed alike and draw alike (no dropout; data and init are counter-based),
    # so it also loads on another world size. Per-rank streams would need rank keys, which cannot map onto that.
    return {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}


def set_rng(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:  # on a GPU resuming a CPU checkpoint, this is the template's own state, set back unchanged
        torch.cuda.set_rng_state(state["cuda"])
