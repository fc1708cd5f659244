"""Reading DCP checkpoints safely, and in one process when need be (scripts, tests, export, generation).

DCP unpickles `.metadata` with plain pickle and non-tensor values with torch.load(weights_only=False); both would run
whatever a crafted checkpoint names, so both go through allow-lists here. DCP's own errors for a checkpoint of another
model come from deep inside DTensor; check_fits names the tensor instead.
"""

from __future__ import annotations

import os
import pickle
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from torchtitan_lite.config import ConfigError

_METADATA_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _Disallowed(pickle.UnpicklingError):
    """A global the allow-list refuses: a crafted file, not a damaged one."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or dtype:
            return super().find_class(module, name)
        raise _Disallowed(f"{module}.{name} is not allowed in checkpoint metadata")


def read_metadata(path: str) -> Metadata:
    """A checkpoint's `.metadata` (each key's global shape and dtype), unpickled with an allow-list; ConfigError (one
    line naming the file) when it is missing, truncated or not DCP's."""
    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Disallowed as e:
        raise ConfigError(f"{file}: {e}: refusing to load it") from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises anything (EOFError, KeyError, ValueError, ...)
        raise ConfigError(f"{file} cannot be read ({type(e).__name__}: {e}): the checkpoint is corrupt or was cut "
                          "short; use another step-N folder") from None
    if not isinstance(metadata, Metadata):
        raise ConfigError(f"{file} holds a {type(metadata).__name__}, not DCP metadata: use another step-N folder")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, with `.metadata` unpickled through the allow-list (DCP's own read uses plain pickle), once:
    pass `metadata` already read and the file is not read again."""

    def __init__(self, path: str, metadata: Metadata | None = None):
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = self.metadata or read_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value) -> None:
        torch.load(value, weights_only=True)  # plain data only (numbers, strings, containers), or this raises
        value.seek(0)
        super().load_bytes(read_item, value)


def load_local(state: dict[str, Any], path: str, metadata: Metadata | None = None) -> None:
    """dcp.load of `state` (full plain tensors, filled in place) in this one process, with no process group."""
    with warnings.catch_warnings():  # DCP warns that no process group exists, which is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeReader(path, metadata), planner=SafePlanner(), no_dist=True)


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint as a full plain tensor, in this one process (tests, scripts): key -> tensor."""
    metadata = read_metadata(path)
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    load_local(state, path, metadata)
    return state


def flatten_state(state: dict[str, Any]) -> dict[str, Any]:
    """A state dict under the dotted keys DCP flattens nested dicts (and lists holding tensors or dicts) into."""
    return {key: v for k, value in state.items() for key, v in _flatten(k, value, {}).items()}


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in value):
        value = dict(enumerate(value))
    if not isinstance(value, dict):
        out[prefix] = value
    for k, v in value.items() if isinstance(value, dict) else ():
        _flatten(f"{prefix}.{k}", v, out)
    return out


def _optimizer_of(keys) -> str:
    """The optimizer whose state `keys` (a checkpoint's flat names) hold: Muon's matrices keep a momentum buffer, its
    other parameters and AdamW's every one two moments."""
    return "Muon" if any(k.endswith(".momentum_buffer") for k in keys) else "AdamW"


def check_fits(state: dict[str, Any], path: str, metadata: Metadata) -> None:
    """Every key this run loads is in the checkpoint (`path`, whose `metadata` the caller read) with the same global
    shape, and the checkpoint's model has no tensor this model lacks; else one line naming the tensor instead of
    DCP's errors from deep in DTensor."""
    saved = metadata.state_dict_metadata
    ours = flatten_state(state)
    for key, value in ours.items():
        if key.startswith(("rng.", "update_guard.", "lr_scheduler.settings.", "dataloader.digest")):
            continue  # a CPU checkpoint has no rng.cuda, nor an fp32 one a loss scale, nor an older one the lr
            # schedule's settings (optim.LRSchedule) or the data's digest (data/digest.py): what is there is loaded
        if key not in saved:
            theirs, mine = _optimizer_of(saved), _optimizer_of(ours)
            if key.startswith("optimizer.") and theirs != mine:
                raise ConfigError(f"checkpoint {path} holds {theirs}'s state and this run's optimizer.name is {mine}: "
                                  f"resume with optimizer.name {theirs}, or start from its weights alone "
                                  f"(checkpoint.initial_load_path with checkpoint.initial_load_model_only)")
            raise ConfigError(f"checkpoint {path} has no {key}: it was saved from another model or setup")
        if isinstance(value, torch.Tensor) and tuple(saved[key].size) != tuple(value.shape):
            raise ConfigError(
                f"checkpoint {path} does not fit this model: {key} has shape {tuple(saved[key].size)} in the "
                f"checkpoint but {tuple(value.shape)} here (check model.flavor and model.tokenizer_path)")
    extra = sorted(k for k in saved if k.startswith("model.") and k not in ours)
    if extra:
        raise ConfigError(f"checkpoint {path} does not fit this model: it holds {extra[0]}, which this model lacks "
                          f"({len(extra)} such tensors; check model.flavor)")
