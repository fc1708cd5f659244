"""The optimizers by name, what optimizer.name selects: each a builder of (model, config, device type, the model's
parameter groups). AdamW updates every parameter alike; Muon (muon.py) orthogonalizes the model's matrices, which the
spec's param_group names, and gives the rest to AdamW. A new optimizer is a builder and a line in OPTIMIZERS, its
settings a config section of its own ([muon]).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchtitan_lite.config import ConfigError, JobConfig, did_you_mean
from torchtitan_lite.models.init import canonical_name
from torchtitan_lite.training.muon import NS_COEFFICIENTS, Muon
from torchtitan_lite.training.optim import AdamW, adamw_settings


def adamw(model: nn.Module, cfg: JobConfig, device_type: str, param_group=None) -> torch.optim.Optimizer:
    return AdamW(model.parameters(), lr=cfg.optimizer.lr, **adamw_settings(cfg.optimizer, device_type))


def muon(model: nn.Module, cfg: JobConfig, device_type: str, param_group: Callable[[str], str]) -> Muon:
    """The model's matrices (param_group "matrix", an expert's 3-D weight a stack of them) in one Muon group, the rest
    in one AdamW group at muon.adamw_lr."""
    m = cfg.muon
    named = [(canonical_name(n), p) for n, p in model.named_parameters()]
    matrices = [p for n, p in named if param_group(n) == "matrix"]
    rest = [p for n, p in named if param_group(n) != "matrix"]
    settings = {"muon": True, "momentum": m.momentum, "nesterov": m.nesterov, "ns_steps": m.ns_steps,
                "ns_coefficients": NS_COEFFICIENTS, "ns_eps": 1e-7, "ns_dtype": torch.float32,
                "adjust_lr": m.adjust_lr}
    groups = [{"params": rest, "muon": False, "lr": m.adamw_lr or cfg.optimizer.lr},
              {"params": matrices, "lr": cfg.optimizer.lr, **settings}]
    return Muon([g for g in groups if g["params"]], lr=cfg.optimizer.lr,
                **adamw_settings(cfg.optimizer, device_type))


OPTIMIZERS = {"AdamW": adamw, "Muon": muon}


def build_optimizer(model: nn.Module, cfg: JobConfig, device_type: str,
                    param_group: Callable[[str], str] | None = None) -> torch.optim.Optimizer:
    """The optimizer optimizer.name names over `model`'s parameters (this rank's, under their full-model names);
    `param_group`: the model's spec's (which parameters are matrices)."""
    return OPTIMIZERS[check_optimizer(cfg, param_group)](model, cfg, device_type, param_group)


def check_optimizer(cfg: JobConfig, param_group: Callable[[str], str] | None) -> str:
    """optimizer.name, or one ConfigError line: an unknown name, or what Muon cannot run with."""
    name = cfg.optimizer.name
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name {name!r} is not a registered optimizer: choose one of "
                          f"{', '.join(OPTIMIZERS)}{did_you_mean(name, list(OPTIMIZERS))}")
    if name == "Muon" and param_group is None:
        raise ConfigError(f"optimizer.name Muon needs to know which parameters are matrices, and model "
                          f"{cfg.model.name}'s spec does not say (param_group): use AdamW")
    if name == "Muon" and cfg.fault_tolerance.enable:
        raise ConfigError("optimizer.name Muon with fault_tolerance.enable: a healing replica group's Muon state is "
                          "not yet tested; use AdamW with replica groups")
    return name
