"""A replica group's state as it travels to a group that heals, and its digest (training/replicas.py).

The groups' layouts are alike, so what travels is each tensor's local shard, from a rank to the same rank of the
group behind, which copies it into its own DTensors: no resharding, no collective within a group.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor


def local(value: Any) -> Any:
    """`value` (a state dict) with each DTensor as this rank's local shard."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local(v) for v in value)
    return value


def filled(template: Any, received: Any) -> Any:
    """`template` (this rank's own state) with the received values: local shards copied into its DTensors."""
    if isinstance(template, DTensor):
        template.to_local().copy_(received)
        return template
    if isinstance(template, dict):
        return {k: filled(template[k], v) if k in template else v for k, v in received.items()}
    return received


def _flat(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in _flat(v, f"{prefix}{k}.")]
    return [(prefix, value)]


def digest(states: dict[str, Stateful]) -> str:
    """A hash of this rank's weights and optimizer state, bytes and all: equal on the same rank of every group."""
    h = hashlib.sha256()
    for k in ("model", "optimizer"):
        for name, value in sorted(_flat(local(states[k].state_dict()))):
            h.update(name.encode())
            h.update(value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                     if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()[:16]
