"""A run that starts from a Hugging Face folder (`checkpoint.initial_load_in_hf`, torchtitan's name), and reading such
a folder one tensor at a time, which the converters (tools/hf_convert.py) share.

Why no DCP checkpoint in between: a downloaded model is a folder of safetensors, and converting it first (scripts/
convert_from_hf.py) costs a second copy of the model on disk and a step to forget. Why every rank reads for itself:
each reads, one tensor at a time, the tensors it holds a piece of (a pipeline stage only its blocks'), converts each
with the model's adapter (its spec's HFAdapter: names, layouts, a mixture's experts one tensor each) and keeps its
own piece, cut by `distribute_tensor(..., src_data_rank=None)`, which in torch 2.13 slices locally without any
communication, for Shard and FSDP's _StridedShard alike. No process ever holds more than one full tensor, and no rank
waits on another until all have read. What is loaded is the parameters, and the persistent buffers the folder holds
(DeepSeek-V3's selection bias, by which its model routes); others (a selection bias of a folder without one) start
as a fresh run starts them. A parameter under two names (tied embeddings) is filled once; a folder of such a
model has no lm_head.weight, and a stage that holds only the output projection reads the embedding for it. A tensor
the folder holds twice and ours once (the copies in DeepSeek-V3's MTP layers: HFAdapter.copies) is read under its
first name alone. The adapter is bound to the run's args, since some names depend on them (HFAdapter.bound).

Before any process talks, `check_hf` refuses what cannot work in one line (training/preflight.py): no folder, a model
without an adapter, a config.json of another shape than model.name/flavor (the vocabulary must hold the tokenizer's;
the context is training.seq_len's, whatever max_position_embeddings says), a tensor missing or of another shape.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan_lite.checkpoint.folder import checkpoint_to_load
from torchtitan_lite.checkpoint.states import model_state
from torchtitan_lite.config import ConfigError, JobConfig
from torchtitan_lite.models import registry
from torchtitan_lite.models.spec import Args, ConversionError, HFAdapter, ModelSpec

logger = logging.getLogger("torchtitan_lite")

# config.json's keys that may differ between the folder and the run: the run's own vocabulary (checked apart),
# context, token ids and dtype, and the auxiliary loss's settings, which are training's, not the model's.
_RUN_KEYS = {"vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id", "torch_dtype", "dtype",
             "router_aux_loss_coef", "output_router_logits"}


def adapter(model: str, args: Args | None = None) -> tuple[ModelSpec, HFAdapter]:
    """The spec registered as `model` and its Hugging Face adapter, bound to a model of `args` where given (its names
    may depend on them: HFAdapter.bound), or ConversionError when it has none."""
    spec = registry.get(model)
    if spec.hf is None:
        raise ConversionError(f"model {model} has no Hugging Face adapter (its spec's hf)")
    return spec, spec.hf if args is None else spec.hf.bound(args)


def loaded_shapes(spec: ModelSpec, args: Args, hf: HFAdapter, weights: dict) -> dict[str, tuple[int, ...]]:
    """What a start from the folder whose tensors are `weights` fills: every parameter (a tied one under each of its
    names) and the persistent buffers the folder holds, by name and shape."""
    held = {hf.our_name(name) for name in weights}
    return {**expected_shapes(spec, args, parameters=True),
            **{name: shape for name, shape in expected_shapes(spec, args).items() if name in held}}


def expected_shapes(spec: ModelSpec, args: Args, parameters: bool = False) -> dict[str, tuple[int, ...]]:
    """Our tensor names and shapes (the state dict's; with `parameters`, the parameters', a tied one under each of
    its names), in the model's order, without allocating anything."""
    with torch.device("meta"):
        model = spec.model_class(args)
    found = model.named_parameters(remove_duplicate=False) if parameters else model.state_dict().items()
    return {name: tuple(p.shape) for name, p in found}


def pieces(hf: HFAdapter, expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, int | None, tuple]]:
    """Each of our tensors as Hugging Face holds it: one piece, or one per index of its first dim where the adapter
    splits it (hf.split: "name.i", a routed expert's): piece -> (our name, index or None, the piece's shape)."""
    return {piece: entry for name, shape in expected.items()
            for piece, entry in ({f"{name}.{i}": (name, i, shape[1:]) for i in range(shape[0])} if hf.split(name)
                                 else {name: (name, None, shape)}).items()}


# ---- The folder's files

def read_config(hf_dir: Path) -> dict:
    try:
        return json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"{hf_dir}/config.json cannot be read: {e}") from None


def safetensors_index(hf_dir: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
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


def read_tensor(file: Path, name: str) -> torch.Tensor:
    # Opened for each tensor: safetensors maps the whole file, and the pages read would stay in this process's
    # resident memory (a 5GB shard's worth) for as long as the file stayed open.
    with safe_open(file, "pt") as f:
        return f.get_tensor(name)


def sources(hf_dir: Path, hf: HFAdapter, config: dict, wanted: dict[str, tuple], weights: dict[str, tuple],
            model: str) -> dict[str, str]:
    """Our piece -> the Hugging Face tensor it is read from, for every piece `wanted` (pieces()), checked: no piece
    missing, none of another shape, no tensor of the folder left without a place. Tied embeddings (no lm_head.weight)
    read the output projection from the embedding."""
    source: dict[str, str] = {}
    for name in weights:
        if name in hf.copies:  # a tensor ours holds once, read under its own name (models/deepseek_v3/hf.py: why)
            continue
        ours = hf.our_name(name)
        if ours is None and not name.endswith("rotary_emb.inv_freq"):  # old folders saved RoPE's buffer: derived
            raise ConversionError(f"{hf_dir} holds {name}, which our {model} model has no place for")
        if ours is not None:
            source[ours] = name
    if "output.weight" not in source and config.get("tie_word_embeddings"):
        source["output.weight"] = hf.hf_name("tok_embeddings.weight")
    if missing := [n for n in wanted if n not in source]:
        raise ConversionError(f"{hf_dir} has no {hf.hf_name(missing[0])} ({len(missing)} tensors missing)")
    for ours, name in source.items():
        if ours not in wanted:  # an expert beyond num_local_experts
            raise ConversionError(f"{hf_dir} holds {name}, which config.json's model has no place for")
        if weights[name][1] != wanted[ours][2]:
            raise ConversionError(f"{hf_dir}: {name} has shape {weights[name][1]} but config.json makes it "
                                  f"{wanted[ours][2]}")
    return source


# ---- The trainer's checks and load

def check_hf(cfg: JobConfig, args: Args) -> None:
    """The Hugging Face options' refusals, each one line (ConfigError), before any process talks: `args` are the
    run's model args, its vocabulary the tokenizer's or the folder's padded one (data/hf_tokenizer.run_vocab_size)."""
    ck = cfg.checkpoint
    if ck.initial_load_in_hf and not ck.initial_load_path:
        raise ConfigError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path: the Hugging Face folder "
                          "(config.json + safetensors) to start from")
    if ck.initial_load_in_hf and not ck.initial_load_model_only:
        raise ConfigError("checkpoint.initial_load_in_hf: a Hugging Face folder holds weights alone: set "
                          "checkpoint.initial_load_model_only = true")
    if ck.last_save_in_hf and not ck.enable:
        raise ConfigError("checkpoint.last_save_in_hf converts the last checkpoint: set checkpoint.enable")
    for key in ("initial_load_in_hf", "last_save_in_hf"):
        if getattr(ck, key) and registry.get(cfg.model.name).hf is None:
            raise ConfigError(f"checkpoint.{key}: model {cfg.model.name} has no Hugging Face adapter (its spec's "
                              "hf): start from a DCP checkpoint, and keep the last save in DCP")
    if ck.last_save_in_hf:
        try:
            registry.get(cfg.model.name).hf.config(args, 0, 0, torch.float32)
        except ConversionError as e:
            raise ConfigError(f"checkpoint.last_save_in_hf: {e}") from None
    # The folder only when the run will load it: a resume reads its own checkpoint.
    if ck.initial_load_in_hf and checkpoint_to_load(ck, os.path.join(cfg.job.dump_folder, ck.folder))[2]:
        try:
            check_folder(Path(ck.initial_load_path), cfg, args)
        except ConversionError as e:
            raise ConfigError(f"checkpoint.initial_load_path: {e}") from None


def check_folder(hf_dir: Path, cfg: JobConfig, args: Args) -> None:
    """The folder's config.json builds the run's model, and the folder holds every parameter of it."""
    spec, hf = adapter(cfg.model.name, args)
    config = read_config(hf_dir)
    theirs = hf.args_from_config(config)
    if theirs.vocab_size != args.vocab_size:
        whose = ("model.tokenizer_path's tokenizer" if cfg.model.tokenizer_path else
                 "the folder's tokenizer (byte level where it has none)")
        fix = "set it to \"\" to use the folder's own, or" if cfg.model.tokenizer_path else "set model.tokenizer_path"
        raise ConversionError(f"{hf_dir}/config.json's vocab_size is {theirs.vocab_size} but {whose} has "
                              f"{args.vocab_size} ids: {fix} to a tokenizer of at most {theirs.vocab_size} ids")
    theirs = dataclasses.replace(theirs, vocab_size=args.vocab_size, max_seq_len=args.max_seq_len)
    run = f"model.name {cfg.model.name}, model.flavor {cfg.model.flavor}"
    flavor = hf.flavor_of(theirs)
    hint = f": set model.flavor {flavor}" if flavor and flavor != cfg.model.flavor else ""
    # a depth no flavor has (a folder saved without its MTP modules) is a setting, not a flavor
    if not hint and getattr(theirs, "mtp_depth", 0) != getattr(args, "mtp_depth", 0):
        hint = f": set model.mtp_depth {theirs.mtp_depth}"
    ours_shapes, their_shapes = (expected_shapes(spec, a, parameters=True) for a in (args, theirs))
    for name in {**ours_shapes, **their_shapes}:
        if ours_shapes.get(name) != their_shapes.get(name):
            raise ConversionError(f"{hf_dir}/config.json describes another model than {run}: {name} is "
                                  f"{their_shapes.get(name, 'absent')} there, {ours_shapes.get(name, 'absent')} "
                                  f"here{hint}")
    try:  # what no shape shows (rope theta, norm eps, ...), in config.json's terms
        mine, its = (hf.config(a, 0, 0, torch.float32) for a in (args, theirs))
    except ConversionError:  # the run's settings have no Hugging Face form (its last save is refused apart)
        mine = its = {}
    for key in sorted(set(mine) | set(its)):
        if key not in _RUN_KEYS and mine.get(key) != its.get(key):
            raise ConversionError(f"{hf_dir}/config.json describes another model than {run}: {key} is "
                                  f"{json.dumps(its.get(key))} there, {json.dumps(mine.get(key))} here{hint}")
    weights = safetensors_index(hf_dir)
    sources(hf_dir, hf, config, pieces(hf, loaded_shapes(spec, args, hf, weights)), weights, cfg.model.name)


def load_hf(model: nn.Module, hf_dir: str, model_name: str) -> None:
    """Fills every parameter this rank holds (plain tensors or DTensor pieces, on any mesh) from the Hugging Face
    folder, one tensor at a time, then checks with the other ranks that every parameter of the model was filled.
    Collective; a ConfigError on every rank alike when it fails."""
    t0 = time.perf_counter()
    error, filled, names = None, [], []
    try:
        filled, names = _fill(model, Path(hf_dir), model_name)
    except (ConversionError, OSError, ValueError) as e:  # the same verdict for every rank, below
        error = f"checkpoint.initial_load_path {hf_dir}: {e}"
    outcomes = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((error, filled), outcomes, dst=0)
    verdict = [None]
    if dist.get_rank() == 0:
        errors = [e for e, _ in outcomes if e]
        unfilled = set(names) - {n for _, done in outcomes for n in done}
        verdict[0] = errors[0] if errors else (
            f"checkpoint.initial_load_path {hf_dir}: no rank filled {sorted(unfilled)[0]} ({len(unfilled)} tensors "
            "unfilled)" if unfilled else None)
    dist.broadcast_object_list(verdict, src=0)
    dist.barrier()  # gloo may abort a process that exits while its broadcast is in flight (manager._on_rank0)
    if verdict[0]:
        raise ConfigError(verdict[0])
    logger.info("loaded weights from %s (a Hugging Face folder: all %d tensors of the model) in %.2fs: training "
                "starts at step 0", hf_dir, len(names), time.perf_counter() - t0)


def _fill(model: nn.Module, hf_dir: Path, model_name: str) -> tuple[list[str], list[str]]:
    """(the parameters this rank filled, every parameter of the model), each tensor read once."""
    args = model.args  # the whole model's, on every pipeline stage
    spec, hf = adapter(model_name, args)
    config, weights = read_config(hf_dir), safetensors_index(hf_dir)
    expected = loaded_shapes(spec, args, hf, weights)
    wanted = pieces(hf, expected)
    source = sources(hf_dir, hf, config, wanted, weights, model_name)
    state = model_state(model)
    held = state.state_dict()  # this rank's parameters and buffers under their names, DTensors as they are
    filled, done = [], {}
    for name, tensor in held.items():
        if name not in expected:
            continue  # a persistent buffer the folder lacks: as a fresh run starts it
        if id(tensor) in done:  # tied: one parameter under two names
            filled.append(name)
            continue
        if hf.split(name):  # stacked from its pieces, an expert at a time
            full = torch.stack([_piece(hf, name, f"{name}.{i}", source, weights, args)
                                for i in range(expected[name][0])])
        else:
            full = _piece(hf, name, name, source, weights, args)
        if isinstance(tensor, DTensor):
            local = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            target = tensor.to_local()
        else:
            local, target = full, tensor
        if local.shape != target.shape:
            raise ConversionError(f"{name}: the piece cut from the folder's tensor has shape {tuple(local.shape)}, "
                                  f"this rank holds {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(local)
        done[id(tensor)] = name
        filled.append(name)
    state.load_state_dict(held)  # in place for most wrappers; a copy where the state dict was one
    return filled, list(expected)


def _piece(hf: HFAdapter, ours: str, piece: str, source: dict[str, str], weights: dict, args: Args) -> torch.Tensor:
    name = source[piece]
    return hf.to_hf_tensor(ours, read_tensor(weights[name][0], name), args, True)
