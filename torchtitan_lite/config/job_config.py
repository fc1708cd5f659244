"""Typed run configuration: one dataclass per TOML section, everything else derived from them.

A field's default, help, choices and rule (the values it accepts, rules.py) are written once, in `opt(...)`.
TOML loading, `--section.key` overrides, `--help`, unknown-key errors, type, choice and range checks all walk the
dataclasses, so adding an option is one line here and nothing else. Precedence: command line > TOML file
(`--job.config_file`) > defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

try:
    import tomllib as tomli  # Python >= 3.11
except ImportError:
    import tomli

from torchtitan_lite.config.paths import LIST, ONE, absolute, resolve_typed_paths
from torchtitan_lite.config.rules import Rule, at_least, finite_above, finite_at_least, or_auto, within, words_or_count


class ConfigError(ValueError):
    """A problem with the user's configuration; the message is one line naming the key and the fix."""

def opt(default: Any, help: str, choices: tuple[str, ...] = (), rule: Rule | None = None, path: str = "") -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "rule": rule, "path": path})


@dataclass
class Job:
    """where the config came from and where outputs go"""
    config_file: str = opt("", "TOML file the run was read from", path=ONE)
    dump_folder: str = opt("./outputs", "where config.toml, metrics.jsonl, checkpoints and tb/ go", path=ONE)
    description: str = opt("", "free text describing the run")
    print_args: bool = opt(False, "also print the resolved config at start-up (config.toml always holds it)")


@dataclass
class Model:
    """architecture and tokenizer"""
    name: str = opt("llama3", "model family", choices=("llama3",))
    flavor: str = opt("debugmodel", "size preset: a key of the model's flavor table (checked by the trainer)")
    tokenizer_path: str = opt("", '"" = byte-level tokenizer needing no file; else a tiktoken BPE file', path=ONE)


@dataclass
class Optimizer:
    """optimizer and its hyperparameters"""
    name: str = opt("AdamW", "optimizer", choices=("AdamW",))
    lr: float = opt(8e-4, "peak learning rate", rule=finite_above(0))
    beta1: float = opt(0.9, "Adam first-moment decay", rule=within(0, 1, high_open=True))
    beta2: float = opt(0.95, "Adam second-moment decay", rule=within(0, 1, high_open=True))
    eps: float = opt(1e-8, "Adam denominator epsilon", rule=finite_above(0))
    weight_decay: float = opt(0.1, "decoupled weight decay", rule=finite_at_least(0))
    implementation: str = opt("fused", "kernel flavour of the update", choices=("foreach", "fused", "for-loop"))


@dataclass
class LRScheduler:
    """warmup, then a constant stretch, then decay"""
    warmup_steps: int = opt(200, "steps of linear warmup from ~0 to lr", rule=at_least(0))
    decay_ratio: Optional[float] = opt(None, "fraction of steps spent decaying at the end; none = all after warmup",
                                       rule=within(0, 1))
    decay_type: str = opt("linear", "shape of the decay", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = opt(0.0, "lr at the end of decay, as a fraction of lr", rule=within(0, 1))


@dataclass
class Training:
    """batch, length, duration, data and precision"""
    local_batch_size: int = opt(8, "sequences per device per micro-batch", rule=at_least(1))
    global_batch_size: int = opt(-1, "-1 = local x data-parallel degree; larger multiples accumulate gradients",
                                 rule=or_auto(at_least(1), "local x data-parallel degree"))
    seq_len: int = opt(2048, "tokens per sequence", rule=at_least(2))  # inputs and next-token targets
    steps: int = opt(10000, "optimizer steps to train for", rule=at_least(1))
    max_norm: float = opt(1.0, "gradient clipping norm; 0 disables", rule=finite_at_least(0, "0 disables clipping"))
    dataset: str = opt("synthetic", "training dataset name")
    dataset_path: str = opt("", "local path of the dataset, if it needs one", path=LIST)
    dataset_text_field: str = opt("text", "jsonl and hf datasets: the field that holds a document's text")
    mixed_precision_param: str = opt("bfloat16", "compute dtype; float16 adds loss scaling",
                                     choices=("bfloat16", "float32", "float16"))
    mixed_precision_reduce: str = opt("float32", "FSDP gradient reduce dtype", choices=("float32", "bfloat16"))
    mixed_precision_output: str = opt("none", "output dtype", choices=("none", "float32", "bfloat16", "float16"))
    mixed_precision_cast_forward_inputs: bool = opt(True, "FSDP casts sharded modules' float inputs to param dtype")
    seed: int = opt(0, "random seed", rule=Rule("in [0, 2**64)", lambda v: 0 <= v < 2**64))  # what torch takes
    deterministic: bool = opt(False, "torch.use_deterministic_algorithms, for bitwise-reproducible runs")
    skip_nonfinite_steps: int = opt(0, "a NaN/Inf gradient norm stops the run; N > 0 skips up to N such in a row",
                                    rule=at_least(0))
    gc_freq: int = opt(50, "Python GC every N steps, so ranks pause together; 0 leaves automatic GC on",
                       rule=at_least(0, "0 leaves automatic GC on"))


@dataclass
class Parallelism:
    """device mesh degrees; they must multiply to the world size"""
    data_parallel_replicate_degree: int = opt(1, "copies of the model (HSDP across nodes)", rule=at_least(1))
    data_parallel_shard_degree: int = opt(-1, "FSDP shards; -1 = the rest of the world size",
                                          rule=or_auto(at_least(1), "the rest of the world"))
    tensor_parallel_degree: int = opt(1, "heads and FFN split across this many devices", rule=at_least(1))
    disable_loss_parallel: bool = opt(False, "gather logits before the loss instead of a sharded loss under TP")
    fsdp_reshard_after_forward: str = opt(
        "default", "after forward: default (every block but the last), always, never, or N = keep parameters "
        "sharded over groups of N ranks (hpZ; N divides the shard degree) so backward's all-gather stays within them",
        rule=words_or_count(("default", "always", "never"), "default, always, never or a group size >= 1"))
    fsdp_cpu_offload: bool = opt(False, "sharded params, grads and optimizer state in host memory; AdamW runs there")
    fsdp_offload_pin_memory: bool = opt(True, "offload into page-locked host memory (faster copies; needs a GPU)")
    fsdp_prefetch: int = opt(0, "all-gather the next N blocks ahead in forward and backward; 0 = FSDP2's implicit one",
                             rule=at_least(0))
    fsdp_defer_grad_reduce: bool = opt(False, "accumulation: reduce gradients after the last micro-batch only")
    pipeline_parallel_degree: int = opt(1, "pipeline stages across this many ranks (the outermost mesh dim)",
                                        rule=at_least(1))
    pipeline_parallel_schedule: str = opt("1F1B", "torch's schedule name: GPipe, 1F1B, Interleaved1F1B, LoopedBFS")
    pipeline_parallel_microbatches: int = opt(-1, "micro-batches per local batch; -1 = the pipeline degree",
                                              rule=or_auto(at_least(1)))
    pipeline_parallel_layers_per_stage: int = opt(-1, "blocks per stage; -1 = split over 1 stage a rank (see README)",
                                                  rule=or_auto(at_least(1)))
    context_parallel_degree: int = opt(1, "each sequence split across this many ranks (long context; see README)",
                                       rule=at_least(1))
    context_parallel_load_balancer: str = opt("headtail", "a rank's share of the sequence: headtail = chunks i and "
                                              "2cp-1-i (equal causal work), none = one contiguous chunk",
                                              choices=("headtail", "none"))


@dataclass
class Comm:
    """how long a rank waits for its peers before the job is ended as hung"""
    init_timeout_seconds: int = opt(600, "collective timeout from start-up through the first step (which may compile)",
                                    rule=at_least(1))
    train_timeout_seconds: int = opt(100, "collective timeout once training is under way", rule=at_least(1))


@dataclass
class Checkpoint:
    """saving and resuming (DCP)"""
    enable: bool = opt(False, "save checkpoints and resume from the newest one")
    folder: str = opt("checkpoint", "checkpoint folder, under job.dump_folder")
    interval: int = opt(500, "save every N steps", rule=at_least(1))
    continue_on_save_error: bool = opt(False, "a failed save (full disk) is reported and training goes on")
    keep_latest_k: int = opt(0, "keep only the newest K checkpoints; 0 keeps all", rule=at_least(0, "0 keeps all"))
    async_mode: str = opt("disabled", "save in the background", choices=("disabled", "async"))
    last_save_model_only: bool = opt(False, "the final save holds weights only (smaller, but cannot be resumed)")
    export_dtype: str = opt("float32", "dtype of a model-only save", choices=("float32", "bfloat16", "float16"))
    create_seed_checkpoint: bool = opt(False, "write the initial weights at step 0 and exit")
    load_step: int = opt(-1, "step to resume from; -1 = newest complete checkpoint",
                         rule=or_auto(at_least(0), "the newest complete checkpoint"))
    initial_load_path: str = opt("", "checkpoint to start from when the folder holds none", path=ONE)
    initial_load_model_only: bool = opt(True, "load only weights from initial_load_path")


@dataclass
class ActivationCheckpoint:
    """recompute activations in backward to save memory"""
    mode: str = opt("none", "what to recompute", choices=("none", "full", "selective"))
    selective_ac_option: str = opt("2", '"op" (per-op policy) or N: checkpoint every N-th block',
                                   rule=words_or_count(("op",), '"op" or a positive integer'))


@dataclass
class Compile:
    """torch.compile"""
    enable: bool = opt(False, "compile each transformer block")
    backend: str = opt("inductor", "torch.compile backend (aot_eager: traced, not code-generated)",
                       choices=("inductor", "aot_eager", "eager"))


@dataclass
class Metrics:
    """logging"""
    log_freq: int = opt(10, "log every N steps", rule=at_least(1))
    enable_tensorboard: bool = opt(False, "also write TensorBoard events")
    save_tb_folder: str = opt("tb", "TensorBoard folder, under job.dump_folder")


@dataclass
class Validation:
    """periodic evaluation on held-out data"""
    enable: bool = opt(False, "run validation during training")
    dataset: str = opt("", '"" = the training data\'s held-out part (README: Data and tokenizers); else a dataset')
    dataset_path: str = opt("", "local path of that dataset, if it needs one", path=LIST)
    freq: int = opt(100, "validate every N steps", rule=at_least(1))
    steps: int = opt(10, "batches per validation", rule=at_least(1))


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    comm: Comm = field(default_factory=Comm)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)


class _Opt(NamedTuple):
    key: str  # "section.key"
    section: str
    name: str
    type: type  # str, int, float or bool
    optional: bool  # None allowed (Optional[...])
    default: Any
    help: str
    choices: tuple[str, ...]
    rule: Rule | None  # None only for strings and bools: tests/test_config.py holds every number to a rule
    path: str  # paths.ONE or LIST: names files; relative on the command line, it is the caller's (paths.py)


_KIND = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}  # the supported types


def _collect() -> tuple[dict[str, type], dict[str, _Opt]]:
    # get_type_hints, not field.type: under `from __future__ import annotations` the latter is just a string.
    sections = typing.get_type_hints(JobConfig)
    options = {}
    for sec, cls in sections.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            args = typing.get_args(tp)
            base = next((a for a in args if a is not type(None)), tp)
            assert base in _KIND, f"{sec}.{f.name}: parsing {tp} is not implemented"
            options[f"{sec}.{f.name}"] = _Opt(f"{sec}.{f.name}", sec, f.name, base, type(None) in args,
                                              f.default, *(f.metadata[k] for k in ("help", "choices", "rule", "path")))
    return sections, options


SECTIONS, OPTIONS = _collect()  # the one table every loader and checker below walks
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _did_you_mean(name: str, candidates: list[str], prefix: str = "") -> str:
    # Also catch a bare key given without its section ("steps" -> "training.steps").
    close = difflib.get_close_matches(name, candidates, n=3) or [c for c in candidates if c.endswith("." + name)]
    return f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""


def _from_string(o: _Opt, text: str) -> Any:
    """Converts command-line text to the option's type."""
    try:
        if o.optional and text.lower() == "none":
            return None
        if o.type is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        return o.type(text)  # int("1.5") raises, float("3") is fine
    except ValueError:
        kind = _KIND[o.type] + (" or none" if o.optional else "")
        raise ConfigError(f"--{o.key} expects {kind} (got {text!r})") from None


def _coerce(o: _Opt, value: Any, where: str = "") -> Any:
    """Checks a TOML (or programmatically set) value's type; ints are accepted for floats."""
    if value is None and o.optional:
        return None
    if o.type is float and type(value) is int:
        return float(value)
    if isinstance(value, o.type) and not (o.type is int and isinstance(value, bool)):  # bool is an int subclass
        return value
    kind = _KIND[o.type] + (" (leave it out for none)" if o.optional else "")
    raise ConfigError(f"{o.key}{where} must be {kind} (got {type(value).__name__} {value!r})")


def _get(cfg: JobConfig, o: _Opt) -> Any:
    return getattr(getattr(cfg, o.section), o.name)


def _set(cfg: JobConfig, o: _Opt, value: Any) -> None:
    setattr(getattr(cfg, o.section), o.name, value)


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomli.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path} (check --job.config_file)") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except (tomli.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None


def _apply_toml(cfg: JobConfig, data: dict[str, Any], source: str) -> None:
    for sec, table in data.items():
        if sec not in SECTIONS:
            raise ConfigError(f"unknown section [{sec}] in {source}{_did_you_mean(sec, [*SECTIONS, *OPTIONS])}")
        if not isinstance(table, dict):
            raise ConfigError(f"{sec} in {source} must be a table: write [{sec}] and its keys below it")
        for name, value in table.items():
            if (o := OPTIONS.get(key := f"{sec}.{name}")) is None:
                raise ConfigError(f"unknown key {key} in {source}{_did_you_mean(key, list(OPTIONS))}")
            _set(cfg, o, _coerce(o, value, f" in {source}"))


def _parse_cli(argv: list[str]) -> list[tuple[_Opt, Any]]:
    """Turns argv into ordered (option, typed value) pairs; the accepted forms are listed in help_text()."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: options look like --section.key value (see --help)")
        name, eq, text = arg[2:].partition("=")
        negated = name.startswith("no-")
        o = OPTIONS.get(name[3:] if negated else name)
        if o is None:
            raise ConfigError(f"unknown option --{name}{_did_you_mean(name, list(OPTIONS), '--')}")
        if negated:
            if o.type is not bool or eq:
                raise ConfigError(f"--{name}: the --no- form only exists for boolean options and takes no value")
            out.append((o, False))
            continue
        if not eq:
            # A bool flag takes the next word only if it reads as a bool, so `--compile.enable --other ...` works.
            if o.type is bool and (i == len(argv) or argv[i].lower() not in _TRUE + _FALSE):
                out.append((o, True))
                continue
            if i == len(argv) or argv[i].startswith("--"):
                raise ConfigError(f"--{name} is missing its value: write --{name} VALUE or --{name}=VALUE")
            text = argv[i]
            i += 1
        out.append((o, _from_string(o, text)))
    return out


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Builds the run's config from argv (like sys.argv[1:]): defaults, then the TOML file, then CLI overrides."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:
        print(help_text())
        sys.exit(0)
    overrides = _parse_cli(argv)  # parsed first: a typo should fail before any file is read
    cfg = JobConfig()
    path = next((v for o, v in reversed(overrides) if o.key == "job.config_file"), "")
    if path:
        _apply_toml(cfg, _read_toml(absolute(path)), path)
    for o, value in overrides:
        _set(cfg, o, value)
    resolve_typed_paths(cfg, {o for o, _ in overrides if o.path})  # the TOML's own keep resolving as they did
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Raises ConfigError on a wrong type, a value outside its choices, or an impossible value."""
    for o in OPTIONS.values():
        value = _get(cfg, o)
        _coerce(o, value)  # catches configs built in code, which skipped the TOML/CLI checks
        if o.choices and value not in o.choices:
            raise ConfigError(f"{o.key} must be one of {', '.join(o.choices)} (got {value!r})")
        if o.rule and value is not None and not o.rule.ok(value):
            raise ConfigError(f"{o.key} must be {_allowed(o)} (got {value!r})")


def _allowed(o: _Opt) -> str:
    return ("none or " if o.optional else "") + o.rule.text


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # JSON string escapes are a subset of TOML's, except that TOML also bans DEL
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(value)  # repr round-trips floats exactly (8e-4 -> 0.0008), and TOML reads inf/nan/1e-08


def to_toml(cfg: JobConfig) -> str:
    """The fully resolved config as TOML; None values are left out (TOML has no null) and reload as None."""
    lines = ["# Fully resolved torchtitan_lite config: loading this file alone reproduces the run's settings."]
    for sec in SECTIONS:
        lines += ["", f"[{sec}]"]
        for o in (o for o in OPTIONS.values() if o.section == sec):
            value = _get(cfg, o)
            if value is not None:
                lines.append(f"{o.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def help_text() -> str:
    """Every option, grouped by section, with its type, default, choices or rule, and doc."""
    lines = [
        "usage: train.py [--job.config_file FILE] [--section.key VALUE | --section.key=VALUE ...]",
        "Precedence: command line > TOML file > defaults. Booleans: --section.key, --no-section.key,",
        "or --section.key true|false. Optional numbers accept 'none'.",
    ]
    for sec, cls in SECTIONS.items():
        lines += ["", f"[{sec}]  {cls.__doc__}"]
        for o in (o for o in OPTIONS.values() if o.section == sec):
            kind = o.type.__name__ + ("|none" if o.optional else "")
            default = "none" if o.default is None else _toml_value(o.default)
            choices = f"  {{{', '.join(o.choices)}}}" if o.choices else ""
            rule = f"  must be {_allowed(o)}" if o.rule else ""
            lines += [f"  --{o.key} {kind} = {default}{choices}{rule}", f"      {o.help}"]
    return "\n".join(lines)
