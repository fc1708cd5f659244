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
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchtitan_lite.config import ConfigError

_METADATA_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_metadata(path: str) -> Metadata:
    """A checkpoint's `.metadata` (each key's global shape and dtype), unpickled with an allow-list."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return _MetadataUnpickler(f).load()


class SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        read_metadata(str(self.path))  # raises on a disallowed global before DCP's own pickle.load runs
        return super().read_metadata(*args, **kwargs)


class SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value) -> None:
        torch.load(value, weights_only=True)  # plain data only (numbers, strings, containers), or this raises
        value.seek(0)
        super().load_bytes(read_item, value)


def load_local(state: dict[str, Any], path: str, reader: SafeReader | None = None) -> None:
    """dcp.load of `state` (full plain tensors, filled in place) in this one process, with no process group."""
    with warnings.catch_warnings():  # DCP warns that no process group exists, which is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader or SafeReader(path), planner=SafePlanner(), no_dist=True)


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint as a full plain tensor, in this one process (tests, scripts): key -> tensor."""
    md = read_metadata(path).state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items()
             if isinstance(m, TensorStorageMetadata)}
    load_local(state, path)
    return state


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    """The dotted keys DCP flattens nested dicts (and lists holding tensors or dicts) into."""
    if isinstance(value, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in value):
        value = dict(enumerate(value))
    if not isinstance(value, dict):
        out[prefix] = value
    for k, v in value.items() if isinstance(value, dict) else ():
        _flatten(f"{prefix}.{k}", v, out)
    return out


def check_fits(state: dict[str, Any], path: str) -> None:
    """Every key this run loads is in the checkpoint with the same global shape, and the checkpoint's model has no
    tensor this model lacks; else one line naming the tensor instead of DCP's errors from deep in DTensor."""
    try:
        saved = read_metadata(path).state_dict_metadata
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise ConfigError(f"{path} is not a readable DCP checkpoint: {e}") from None
    ours = {key: v for k, value in state.items() for key, v in _flatten(k, value, {}).items()}
    for key, value in ours.items():
        if key.startswith(("rng.", "update_guard.")):
            continue  # a CPU checkpoint has no rng.cuda, nor an fp32 one a loss scale: what is there is loaded
        if key not in saved:
            raise ConfigError(f"checkpoint {path} has no {key}: it was saved from another model or setup")
        if isinstance(value, torch.Tensor) and tuple(saved[key].size) != tuple(value.shape):
            raise ConfigError(
                f"checkpoint {path} does not fit this model: {key} has shape {tuple(saved[key].size)} in the "
                f"checkpoint but {tuple(value.shape)} here (check model.flavor and model.tokenizer_path)")
    extra = sorted(k for k in saved if k.startswith("model.") and k not in ours)
    if extra:
        raise ConfigError(f"checkpoint {path} does not fit this model: it holds {extra[0]}, which this model lacks "
                          f"({len(extra)} such tensors; check model.flavor)")
