"""Hugging Face conversion: our DCP checkpoints to and from a Hugging Face folder (config.json + safetensors).

Both directions stream, one tensor at a time, so a 70B model converts on a machine that cannot hold it. Export reads
one key per DCP load (DCP loads a subset of a checkpoint, on any mesh it was saved from, with no process group) and
writes safetensors itself: the format is an 8-byte length, a JSON header and the raw bytes, and every shape and
dtype is known from the DCP metadata before any data is read, so the header goes first and tensors follow as they
are read. (The safetensors library wants every tensor of a file in memory at once.) Import hands DCP a state dict
of meta tensors, which plan the save, and a planner that reads each real tensor from safetensors only when DCP's
writer asks for it; one file per tensor, since DCP's writer keeps a file's tensors until the file is closed.
Names, layouts and configs are the model's (its spec's HFAdapter: Llama's in models/llama3/hf.py, Qwen3's in
models/qwen3/hf.py, DeepSeek-V3's in models/deepseek_v3/hf.py); a conversion that fails leaves no output folder
behind. Reading a folder is shared with the trainer, which starts from one without a conversion
(checkpoint/hf_load.py); its last save becomes one here (`checkpoint.last_save_in_hf`: export_last_save).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
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
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan_lite.checkpoint.folder import complete_checkpoints
from torchtitan_lite.checkpoint.hf_load import (adapter, expected_shapes, pieces, read_config, read_tensor,
                                                safetensors_index, sources)
from torchtitan_lite.checkpoint.manager import CheckpointSaveError
from torchtitan_lite.checkpoint.reader import load_local, read_metadata
from torchtitan_lite.config import JobConfig, Model
from torchtitan_lite.data.hf_tokenizer import run_tokenizer, run_vocab_size, save_hf_tokenizer
from torchtitan_lite.models import registry
from torchtitan_lite.models.spec import Args, ConversionError, ModelSpec

logger = logging.getLogger("torchtitan_lite")
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # transformers' save_pretrained default, "5GB"
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DEFAULT_MODEL = Model().name  # the config's default model.name


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

def tied_names(spec: ModelSpec, args: Args) -> set[str]:
    """Our tensor names that are a parameter already named earlier in the model (tied embeddings' output.weight): a
    checkpoint holds it under both, a Hugging Face folder once (config.json's tie_word_embeddings says so)."""
    with torch.device("meta"):
        model = spec.model_class(args)
    return {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()


def export_to_hf(ckpt: str | Path, out: str | Path, args: Args, bos_id: int, eos_id: int,
                 dtype: torch.dtype | None = None, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                 add_files: Callable[[Path], None] | None = None, model: str = DEFAULT_MODEL) -> None:
    """Writes the `model.*` weights of the DCP checkpoint `ckpt` (saved on any mesh, full state or weights only) of
    the model `model` (model.name) as the Hugging Face folder `out`, cast to `dtype` (default: as saved).
    add_files(folder) adds files (a tokenizer)."""
    ckpt = str(ckpt)
    spec, hf = adapter(model, args)
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
    tied = tied_names(spec, args)  # written once, as transformers' save_pretrained writes tied embeddings
    ours_of = {hf.hf_name(piece): entry for piece, entry in pieces(hf, expected).items() if entry[0] not in tied}
    # Their second copy of a tensor ours holds once (DeepSeek-V3's MTP embedding and head): read from the
    # checkpoint again when its turn comes, so that one tensor at a time is still all that is held
    ours_of |= {theirs: (ours, None, expected[ours]) for theirs, ours in hf.copies.items()}
    absent = hf.absent(args)  # theirs holds them, ours does not: written as the adapter gives them
    # Persistent buffers (DeepSeek-V3's selection bias) stay fp32 whatever `dtype`, as published and as transformers
    # keeps them: steps of 1e-3 rounded to bf16 would route otherwise.
    buffers = set(expected) - set(expected_shapes(spec, args, parameters=True))
    kept = {name for name, entry in ours_of.items() if entry[0] in buffers} | set(absent)
    dtype_of = {name: torch.float32 if name in kept else dtype for name in [*ours_of, *absent]}
    entries = [(name, shape, dtype_of[name]) for name, (_, _, shape) in ours_of.items()]
    entries += [(name, tuple(tensor.shape), dtype_of[name]) for name, tensor in absent.items()]
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
        if name in absent:
            return absent[name].to(dtype_of[name])
        ours, index, _ = ours_of[name]
        tensor = load(ours) if index is None else load(ours)[index]
        progress.update(tensor.numel() * dtype.itemsize)
        return hf.to_hf_tensor(ours, tensor, args, False).to(dtype_of[name])

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


def export_run(ckpt: str | Path, out: str | Path, cfg: JobConfig, dtype: torch.dtype | None = None,
               max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> None:
    """export_to_hf of a checkpoint of the run `cfg` configures: its model, and its tokenizer written beside."""
    tokenizer = run_tokenizer(cfg)
    args = registry.get(cfg.model.name).run_args(cfg, run_vocab_size(cfg, tokenizer))
    export_to_hf(ckpt, out, args, tokenizer.bos_id, tokenizer.eos_id, dtype, max_shard_size, model=cfg.model.name,
                 add_files=lambda folder: save_hf_tokenizer(tokenizer, folder, model_max_length=args.max_seq_len))


def export_last_save(cfg: JobConfig, step: int) -> Path:
    """checkpoint.last_save_in_hf: the run's step-N, just saved, as the Hugging Face folder step-N-hf beside it
    (one process, once every rank has saved), said in one line; a failure is a CheckpointSaveError line that leaves
    step-N as it is. A step-N-hf already there was made from the step-N this save replaced, and goes first. Returns
    the folder."""
    ckpt = complete_checkpoints(os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)).get(step)
    try:
        if ckpt is None:  # a save that failed under checkpoint.continue_on_save_error
            raise ConversionError(f"no checkpoint step-{step} to convert (its save failed)")
        out = Path(f"{ckpt}-hf")
        shutil.rmtree(out, ignore_errors=True)
        export_run(ckpt, out, cfg)
    except (ConversionError, OSError) as e:
        raise CheckpointSaveError(f"checkpoint.last_save_in_hf: {e} (step-{step} is intact: scripts/convert_to_hf.py "
                                  "converts it)") from None
    logger.info("saved the last checkpoint as the Hugging Face folder %s", out)
    return out


# ---- Import: Hugging Face folder -> DCP checkpoint

class _LazySavePlanner(DefaultSavePlanner):
    """Plans the save from meta tensors; each real tensor is made only when DCP's writer asks for it."""

    def __init__(self, make: Callable[[str], torch.Tensor]):
        super().__init__()
        self.make = make

    def resolve_data(self, write_item):
        return self.make(write_item.index.fqn.removeprefix("model."))


def import_from_hf(hf_dir: str | Path, out: str | Path, dtype: torch.dtype = torch.float32,
                   add_files: Callable[[Path, Args], None] | None = None, model: str = DEFAULT_MODEL) -> Args:
    """Writes the weights of the Hugging Face folder `hf_dir` of the model `model` (model.name) as a weights-only DCP
    checkpoint `out` (keys `model.*`, loadable on any mesh, e.g. as checkpoint.initial_load_path) in `dtype`;
    add_files(folder, args) runs first. Returns our args for it. Tied embeddings (no lm_head.weight): the output
    projection is read from the embedding, the same parameter again where our model ties them too (Qwen3's small
    sizes), else a copy that trains apart (Llama's)."""
    hf_dir = Path(hf_dir)
    spec, hf = adapter(model)
    check_free(out)
    config = read_config(hf_dir)
    args = hf.args_from_config(config)
    hf = hf.bound(args)
    weights, expected = safetensors_index(hf_dir), expected_shapes(spec, args)
    source = sources(hf_dir, hf, config, pieces(hf, expected), weights, model)  # our piece -> Hugging Face name
    progress = _Progress(sum(math.prod(s) for s in expected.values()) * dtype.itemsize, "import")

    def piece(ours: str, name: str) -> torch.Tensor:
        tensor = read_tensor(weights[source[name]][0], source[name])
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
