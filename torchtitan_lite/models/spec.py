"""What the rest of the package knows of a model: its spec, the one object `model.name` selects (registry.py).

torchtitan's shape, in our words: an architecture is a folder (llama3/, qwen3/) holding its args and flavors, its
Hugging Face adapter and one `ModelSpec` naming them with its model class, TP plan and FLOP count, most of which are
the shared decoder's (common/). The parallel layer, the trainer and the tools never import an architecture: they call
the spec, so a new architecture is a new folder and a registration, not edits across the layers (docs/extension.md).

Besides the spec's functions, the layers rely on a few things of the model itself, each the least they can:
- `model_class(args)` builds the whole model (train.py builds it on meta); its `args` attribute is those args, which
  hold at least `Args`' fields.
- `layers`: a ModuleDict of its blocks keyed "0".."n-1", the units that activation checkpointing, compile, FSDP and
  pipeline stages work on; a model with blocks outside it (the decoder's multi-token prediction modules) says so by
  `blocks()` (`blocks` below); `init_weights(seed, buffer_device)` initializes every parameter identically on any mesh
  (models/init.py) and recomputes the buffers.
- A pipeline stage is the whole model with the blocks it does not own dropped, and the modules registered before
  `layers` set to None on every stage but the first, those after it on every stage but the last (the last keeps one
  that holds a parameter tied to one after the blocks); the forward takes hidden states, floating point where tokens
  are integers, and gives them where its last modules are None.
- Tied parameters: `tie_weights()`, called after TP replaces the parameters (a model that ties none lacks it).
- Context parallelism needs the model's `attend_with(attend, held_rows)` (common/decoder.py says what it swaps); a
  model without one refuses a context-parallel layout at preflight. Generation needs `kv_cache(batch, max_len)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from torchtitan_lite.config import ConfigError, did_you_mean


def blocks(model: nn.Module) -> list[nn.Module]:
    """Every block `model` holds, the units parallelism wraps: its `blocks()` where it has one, else its layers."""
    return model.blocks() if hasattr(model, "blocks") else list(model.layers.values())


class Args(Protocol):
    """The fields of a model's args that the layers read; a flavor is a frozen dataclass holding at least these."""
    n_layers: int  # blocks: pipeline stages are cut from them
    dim: int  # width of the hidden states between blocks (what pipeline stages send each other)
    vocab_size: int  # set by the run from the tokenizer
    max_seq_len: int  # set by the run from training.seq_len


class TPStyles(NamedTuple):
    """The parallel styles a TP plan is written in, chosen by the parallel layer (parallel/parallelize.py): torch's,
    float8's for a block whose linears cast before they communicate, an embedding style that works around a torch
    bug. Each is called like torch's class of the same role (ColwiseParallel, ...)."""
    colwise: Callable[..., Any]
    rowwise: Callable[..., Any]
    prepare_input: Callable[..., Any]
    sequence: Callable[..., Any]
    embedding: Callable[..., Any]
    # A module every tp rank holds whole and runs on the same inputs (MLA's latents): its parameters replicated,
    # its output a DTensor, or with use_local_output=True a tensor whose gradient each rank's heads give in part.
    replicated: Callable[..., Any] | None = None


class ConversionError(ValueError):
    """A checkpoint or folder that cannot be converted; the message is one line saying what differs."""


@dataclass(frozen=True)
class HFAdapter:
    """A model in Hugging Face's terms, one tensor at a time so that conversions stream (tools/hf_convert.py)."""
    hf_name: Callable[[str], str]  # our parameter name -> theirs
    our_name: Callable[[str], str | None]  # theirs -> ours; None: a tensor our model has no place for
    # (our name, weight, args, inverse) -> the weight in their layout (inverse: theirs back to ours)
    to_hf_tensor: Callable[[str, torch.Tensor, Any, bool], torch.Tensor]
    config: Callable[[Any, int, int, torch.dtype], dict]  # config.json of (args, bos id, eos id, dtype)
    args_from_config: Callable[[dict], Any]  # our args of a config.json, or ConversionError naming what we lack
    flavor_of: Callable[[Any], str | None]  # the flavor that builds exactly these args, vocabulary and context aside
    # our tensor name -> whether it is one of theirs per index of its first dim, each named by hf_name(name + ".i")
    # (a mixture's routed experts as Mixtral holds them)
    split: Callable[[str], bool] = lambda name: False
    # args -> tensors their model holds where ours has none, by their name, which an export writes as given
    # (DeepSeek-V3's selection bias of zeros, for a model trained without one)
    absent: Callable[[Any], dict[str, torch.Tensor]] = lambda args: {}
    # (this adapter, args) -> the adapter of a model of those args, for a layout whose names depend on them
    # (DeepSeek-V3's MTP modules are numbered after the model's blocks); None: the same names whatever the args
    bind: Callable[[HFAdapter, Any], HFAdapter] | None = None
    # their name -> ours, of a tensor their folder holds a second time (DeepSeek-V3's MTP modules hold the embedding
    # and output projection they share with the main model): an export writes ours again under their name, an import
    # reads ours from its own name and skips the copy. Set by `bind`.
    copies: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def bound(self, args) -> HFAdapter:
        """The adapter of a model of `args`: what a conversion uses once it knows them (bind's result; itself when
        the names do not depend on the args, or it is already bound)."""
        return self if self.bind is None else self.bind(self, args)


@dataclass(frozen=True)
class ModelSpec:
    """An architecture as the layers see it."""
    name: str  # what model.name selects
    model_class: type[nn.Module]  # model_class(args): the whole model (the module docstring says what it must have)
    flavors: Mapping[str, Any]  # model.flavor -> its args (Args), vocabulary and context left to the run
    # (styles, loss parallel) -> {module name: style}: the model's own modules by name, each block's as
    # "layers.*.NAME"; with loss parallel the logits stay sharded on the vocabulary
    tp_plan: Callable[[TPStyles, bool], dict[str, Any]]
    tp_sizes: Callable[[Any], dict[str, int]]  # args -> the sizes TP splits, by name: its degree must divide each
    # (the whole model, on meta; seq_len) -> training FLOPs per token (forward and backward): MFU's numerator
    flops_per_token: Callable[[nn.Module, int], float]
    hf: HFAdapter | None = None  # Hugging Face conversion; None: the model has none
    # (args, JobConfig) -> the args with the config's settings of the model over its flavor's (run_args); None: none
    configure: Callable[[Any, Any], Any] | None = None
    # Every block the same module on the same shapes, only its index differs: the memory estimate may then trace a
    # few blocks and extrapolate (tools/memory_extrapolate.py)
    blocks_alike: bool = False
    # a parameter's full-model name -> its group for an optimizer: "matrix", "embedding", "norm", "router" or "bias"
    # (Muon takes the matrices, AdamW the rest); None: the model does not say
    param_group: Callable[[str], str] | None = None
    # model.flavor -> the vocabulary of its published model: what a tool assumes where the config's tokenizer file
    # is missing (tools/memory.py); a flavor without one needs its tokenizer
    published_vocab: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # Shown to give one process's bits on every layout training.layout_invariant covers (its multi-process tests
    # train it); the mode refuses the others, which it touches no differently but has not shown
    bitwise_layouts: bool = False

    def args(self, flavor: str, vocab_size: int, seq_len: int) -> Any:
        """The args a run builds its model from: the flavor's, with the tokenizer's vocabulary and training.seq_len
        as the context (train.py, and every tool that must build the same model: generation, export, memory)."""
        if flavor not in self.flavors:
            raise ConfigError(f"model.flavor {flavor!r} is not a flavor of model {self.name}: choose one of "
                              f"{', '.join(self.flavors)}{did_you_mean(flavor, list(self.flavors))}")
        return dataclasses.replace(self.flavors[flavor], vocab_size=vocab_size, max_seq_len=seq_len)

    def run_args(self, cfg, vocab_size: int) -> Any:
        """The args of the run `cfg` configures: its flavor's (args), with what the config sets over them. A model
        whose spec takes no settings (no `configure`) refuses the [moe] keys rather than ignore them."""
        args = self.args(cfg.model.flavor, vocab_size, cfg.training.seq_len)
        if self.configure:
            return self.configure(args, cfg)
        if set_keys := [f.name for f in dataclasses.fields(cfg.moe) if getattr(cfg.moe, f.name) not in (None, "")]:
            raise ConfigError(f"moe.{set_keys[0]} is set but model {self.name} takes no [moe] settings: remove it")
        return args

    @staticmethod
    def moe(args) -> Any:
        """The mixture of experts of a model's args (models/common/moe.MoEArgs), None for a dense one: the one
        question the layers ask of it, for the refusals and the groups expert parallelism and balancing need."""
        return getattr(args, "moe", None)
