"""Hugging Face conversion: our DCP checkpoints to and from a Hugging Face folder (config.json + safetensors).

Both directions stream, one tensor at a time, so a 70B model converts on a machine that cannot hold it. Export reads
one key per DCP load (DCP loads a subset of a checkpoint, on any mesh it was saved from, with no process group) and
writes safetensors itself: the format is an 8-byte length, a JSON header and the raw bytes, and every shape and
dtype is known from the DCP metadata before any data is read, so the header goes first and tensors follow as they
are read. (The safetensors library wants every tensor of a file in memory at once.) Import hands DCP a state dict
of meta tensors, which plan the save, and a planner that reads each real tensor from safetensors only when DCP's
writer asks for it; one file per tensor, since DCP's writer keeps a file's tensors until the file is closed.
Names, layouts and configs are the model's (its spec's HFAdapter: Llama's in models/llama3/hf.py); a conversion
that fails leaves no output folder behind.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import struct
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan_lite.checkpoint.reader import load_local, read_metadata
from torchtitan_lite.config import Model
from torchtitan_lite.models import registry
from torchtitan_lite.models.spec import Args, ConversionError, HFAdapter, ModelSpec

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # transformers' save_pretrained default, "5GB"
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DEFAULT_MODEL = Model().name  # the config's default model.name


def adapter(model: str) -> tuple[ModelSpec, HFAdapter]:
    """The spec registered as `model` and its Hugging Face adapter, or ConversionError when it has none."""
    spec = registry.get(model)
    if spec.hf is None:
        raise ConversionError(f"model {model} has no Hugging Face adapter (its spec's hf)")
    return spec, spec.hf


def expected_shapes(spec: ModelSpec, args: Args) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes, in the model's order, without allocating anything."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in spec.model_class(args).state_dict().items()}


def pieces(hf: HFAdapter, expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, int | None, tuple]]:
    """Each of our tensors as Hugging Face holds it: one piece, or one per index of its first dim where the adapter
    splits it (hf.split: "name.i", a routed expert's): piece -> (our name, index or None, the piece's shape)."""
    return {piece: entry for name, shape in expected.items()
            for piece, entry in ({f"{name}.{i}": (name, i, shape[1:]) for i in range(shape[0])} if hf.split(name)
                                 else {name: (name, None, shape)}).items()}

# ---- Files

def check_free(out: str | Path) -> Path:
    """`out`, which a conversion may create: it does not exist, or is an empty folder."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"{out} already exists and is not an empty folder: choose a new output folder")
    return out


@contextlib.contextmanager
def atomic_folder(out: str | Path) -> Iterator[Path]:
    """Yields a temporary folder beside `out` that becomes `out` when the block ends without error, and is deleted
    when it fails: a conversion leaves a complete folder or none. `out` must not exist, or be an empty folder."""
    out = check_free(out)
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"  # mkdir, not mkdtemp: the folder gets the umask's mode
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, out)  # replaces an empty folder in one step on POSIX
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                      read: Callable[[str], torch.Tensor]) -> None:
    """A safetensors file of `entries` (name, shape, dtype), the header first, then each tensor as `read(name)`
    returns it: one tensor in memory at a time."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0  # "pt": transformers refuses files without it
    for name, shape, dtype in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    assert sys.byteorder == "little", "safetensors is little-endian and tensors are written as they are in memory"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape, dtype in entries:
            tensor = read(name).contiguous()
            assert tuple(tensor.shape) == shape and tensor.dtype == dtype, name
            f.write(tensor.view(-1).view(torch.uint8).numpy())


def plan_shards(entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_bytes: int) -> list[list]:
    """Consecutive groups of entries of at most max_bytes each; a tensor larger than that is a shard of its own."""
    shards, size = [[]], 0
    for entry in entries:
        n = math.prod(entry[1]) * entry[2].itemsize
        if shards[-1] and size + n > max_bytes:
            shards, size = shards + [[]], 0
        shards[-1].append(entry)
        size += n
    return shards


class _Progress:
    """Bytes converted so far, on stderr when it is a terminal: tqdm's bar if installed, else a line per tenth."""

    def __init__(self, total: int, desc: str):
        self.total, self.done, self.desc, self.bar = max(total, 1), 0, desc, None
        with contextlib.suppress(ImportError):  # optional: conversions work without it
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=None)  # None: tty only

    def update(self, n: int) -> None:
        before, self.done = self.done, self.done + n
        if self.bar is not None:
            self.bar.update(n)
        elif sys.stderr.isatty() and 10 * self.done // self.total > 10 * before // self.total:
            print(f"{self.desc}: {100 * self.done // self.total}% of {self.total / 1e6:.0f} MB", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- Export: DCP checkpoint -> Hugging Face folder

def export_to_hf(ckpt: str | Path, out: str | Path, args: Args, bos_id: int, eos_id: int,
                 dtype: torch.dtype | None = None, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                 add_files: Callable[[Path], None] | None = None, model: str = DEFAULT_MODEL) -> None:
    """Writes the `model.*` weights of the DCP checkpoint `ckpt` (saved on any mesh, full state or weights only) of
    the model `model` (model.name) as the Hugging Face folder `out`, cast to `dtype` (default: as saved).
    add_files(folder) adds files (a tokenizer)."""
    ckpt = str(ckpt)
    spec, hf = adapter(model)
    check_free(out)  # before anything is read: a taken OUT fails at once
    if not os.path.isfile(os.path.join(ckpt, ".metadata")):
        raise ConversionError(f"{ckpt} is not a DCP checkpoint (no .metadata)")
    metadata = read_metadata(ckpt)
    saved = {k.removeprefix("model."): m for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    expected = expected_shapes(spec, args)
    for name, shape in expected.items():
        if (got := f"shape {tuple(saved[name].size)}" if name in saved else "no tensor") != f"shape {shape}":
            raise ConversionError(f"checkpoint {ckpt} does not fit the config: model.{name} has {got} in the "
                                  f"checkpoint but shape {shape} in the config (check model.flavor and "
                                  "model.tokenizer_path, or pass --config)")
    if extra := sorted(set(saved) - set(expected)):
        raise ConversionError(f"checkpoint {ckpt} holds model.{extra[0]}, which the config's model lacks")
    dtype = dtype or saved["tok_embeddings.weight"].properties.dtype
    config = hf.config(args, bos_id, eos_id, dtype)  # first: a model their layout cannot hold is refused unread
    ours_of = {hf.hf_name(piece): entry for piece, entry in pieces(hf, expected).items()}
    entries = [(name, shape, dtype) for name, (_, _, shape) in ours_of.items()]
    shards = plan_shards(entries, max_shard_size)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    progress = _Progress(sum(math.prod(s) * dtype.itemsize for _, s, _ in entries), "export")

    @functools.lru_cache(maxsize=1)  # a split tensor's pieces are written one after another
    def load(ours: str) -> torch.Tensor:
        stored = saved[ours]
        tensor = torch.empty(stored.size, dtype=stored.properties.dtype)
        load_local({"model." + ours: tensor}, ckpt, metadata)  # read once above, not per tensor
        return tensor

    def read(name: str) -> torch.Tensor:
        ours, index, _ = ours_of[name]
        tensor = load(ours) if index is None else load(ours)[index]
        progress.update(tensor.numel() * dtype.itemsize)
        return hf.to_hf_tensor(ours, tensor, args, False).to(dtype)

    with atomic_folder(out) as tmp:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
        if add_files:
            add_files(tmp)
        for file, shard in zip(files, shards):
            write_safetensors(tmp / file, shard, read)
        if len(shards) > 1:
            _write_json(tmp / "model.safetensors.index.json", {
                "metadata": {"total_size": sum(math.prod(s) * d.itemsize for _, s, d in entries)},
                "weight_map": {name: file for file, shard in zip(files, shards) for name, _, _ in shard}})
        progress.close()


# ---- Import: Hugging Face folder -> DCP checkpoint

class _LazySavePlanner(DefaultSavePlanner):
    """Plans the save from meta tensors; each real tensor is made only when DCP's writer asks for it."""

    def __init__(self, make: Callable[[str], torch.Tensor]):
        super().__init__()
        self.make = make

    def resolve_data(self, write_item):
        return self.make(write_item.index.fqn.removeprefix("model."))


def _weights(hf_dir: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Hugging Face tensor name -> (the safetensors file holding it, its shape), from the files' headers."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({hf_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (hf_dir / "model.safetensors").is_file():
        files = [hf_dir / "model.safetensors"]
    else:
        raise ConversionError(f"{hf_dir} has no model.safetensors nor model.safetensors.index.json (pickled "
                              "pytorch_model.bin files are not read: they can run code)")
    found = {}
    for file in files:
        with safe_open(file, "pt") as f:
            found.update({n: (file, tuple(f.get_slice(n).get_shape())) for n in f.keys()})  # noqa: SIM118 - no __iter__
    return found


def _read(file: Path, name: str) -> torch.Tensor:
    # Opened for each tensor: safetensors maps the whole file, and the pages read would stay in this process's
    # resident memory (a 5GB shard's worth) for as long as the file stayed open.
    with safe_open(file, "pt") as f:
        return f.get_tensor(name)


def import_from_hf(hf_dir: str | Path, out: str | Path, dtype: torch.dtype = torch.float32,
                   add_files: Callable[[Path, Args], None] | None = None, model: str = DEFAULT_MODEL) -> Args:
    """Writes the weights of the Hugging Face folder `hf_dir` of the model `model` (model.name) as a weights-only DCP
    checkpoint `out` (keys `model.*`, loadable on any mesh, e.g. as checkpoint.initial_load_path) in `dtype`;
    add_files(folder, args) runs first. Returns our args for it. Tied embeddings are untied: the output projection
    starts as a copy."""
    hf_dir = Path(hf_dir)
    spec, hf = adapter(model)
    check_free(out)
    try:
        config = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"{hf_dir}/config.json cannot be read: {e}") from None
    args = hf.args_from_config(config)
    weights, expected = _weights(hf_dir), expected_shapes(spec, args)
    wanted = pieces(hf, expected)
    source: dict[str, str] = {}  # our piece -> Hugging Face name
    for name in weights:
        ours = hf.our_name(name)
        if ours is None and not name.endswith("rotary_emb.inv_freq"):  # old folders saved RoPE's buffer: derived
            raise ConversionError(f"{hf_dir} holds {name}, which our {model} model has no place for")
        if ours is not None:
            source[ours] = name
    if "output.weight" not in source and config.get("tie_word_embeddings"):
        source["output.weight"] = "model.embed_tokens.weight"
    if missing := [n for n in wanted if n not in source]:
        raise ConversionError(f"{hf_dir} has no {hf.hf_name(missing[0])} ({len(missing)} tensors missing)")
    for ours, name in source.items():
        if ours not in wanted:  # an expert beyond num_local_experts
            raise ConversionError(f"{hf_dir} holds {name}, which config.json's model has no place for")
        if weights[name][1] != wanted[ours][2]:
            raise ConversionError(f"{hf_dir}: {name} has shape {weights[name][1]} but config.json makes it "
                                  f"{wanted[ours][2]}")
    progress = _Progress(sum(math.prod(s) for s in expected.values()) * dtype.itemsize, "import")

    def piece(ours: str, name: str) -> torch.Tensor:
        tensor = _read(weights[source[name]][0], source[name])
        progress.update(tensor.numel() * dtype.itemsize)
        return hf.to_hf_tensor(ours, tensor, args, True).to(dtype)

    def make(ours: str) -> torch.Tensor:
        if hf.split(ours):  # stacked from its pieces, an expert at a time
            return torch.stack([piece(ours, f"{ours}.{i}") for i in range(expected[ours][0])])
        return piece(ours, ours).contiguous()

    state = {"model": {n: torch.empty(s, dtype=dtype, device="meta") for n, s in expected.items()}}
    with atomic_folder(out) as tmp:
        if add_files:
            add_files(tmp, args)
        with warnings.catch_warnings():  # DCP warns that no process group exists, which is the point here
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=FileSystemWriter(tmp, single_file_per_rank=False),
                     planner=_LazySavePlanner(make), no_dist=True)
    progress.close()
    return args
