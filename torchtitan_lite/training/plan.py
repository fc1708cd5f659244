"""What a run will do, said before it does it: a few lines that `train.py --check` prints (run_train.sh shows them
before any worker starts) and rank 0 logs at start-up otherwise, so the console says what is coming while the
processes start, the data is tokenized and the model is built.

Three things a user cannot see from a config file are said here rather than discovered later:
- what the run does with the folder it writes: where its outputs go, and which checkpoint it resumes, or that it
  starts afresh beside another run's checkpoints and leaves them as they are;
- that it has nothing to do (its checkpoint is already at training.steps), before any worker starts;
- that its checkpoints will not export to a Hugging Face folder (a setting the model's HF layout cannot hold: a
  selection bias, shared experts, sigmoid scores, ...), which scripts/convert_to_hf.py refuses only after training;
- that its first step will obviously not finish soon on this machine: a CPU given a GPU-sized step (the defaults are
  torchtitan's, sized for GPUs) or half precision it multiplies slowly. The bound is the step's FLOPs at this CPU's
  measured matmul peak: a run never goes faster, so a warning is never a false alarm by more than the MFU it reaches.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from torchtitan_lite.checkpoint.folder import checkpoint_to_load, complete_checkpoints, read_run_files
from torchtitan_lite.config import JobConfig
from torchtitan_lite.data.mixture import mixture_phases
from torchtitan_lite.models import registry
from torchtitan_lite.models.common.moe import inactive_params
from torchtitan_lite.models.spec import Args, ConversionError, ModelSpec
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.quantization import float8, mxfp8_experts
from torchtitan_lite.runtime.metrics import cpu_peak
from torchtitan_lite.runtime.process import cpu_threads
from torchtitan_lite.training import layout_invariant
from torchtitan_lite.training.step import Numerics

logger = logging.getLogger("torchtitan_lite")
# A step that needs this long at the machine's matmul peak takes minutes as it runs (a CPU's MFU is a few tens of
# percent at best, far less in half precision): a first step a user would take for a hang.
SLOW_STEP_S = 20.0


@dataclass
class Plan:
    lines: list[str]  # what the run is and where it writes
    warnings: list[str] = field(default_factory=list)  # what the user would want to change before it starts
    nothing_to_do: str = ""  # the line of a run whose checkpoint is already at training.steps
    checkpoint_folder: str = ""  # "" with checkpointing off: run_train.sh's second Ctrl-C names what it kept

    def say(self) -> None:
        for line in self.lines:
            logger.info("%s", line)
        for line in self.warnings:
            logger.warning("%s", line)


def _steps(steps: list[int]) -> str:
    named = [f"step-{s}" for s in steps]
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"


def _model(cfg: JobConfig, n_params: int, active: int, dims: ParallelDims) -> str:
    extras = [f"{cfg.model.attn_mask_type} attention" + (" (documents masked at each BOS)"
                                                         if cfg.model.attn_mask_type == "block_causal" else ""),
              cfg.training.mixed_precision_param]
    if float8.enabled(cfg):
        extras.append(f"float8 {cfg.float8.recipe_name} matmuls" + (" (emulated)" if cfg.float8.emulate else ""))
    if mxfp8_experts.enabled(cfg):
        extras.append(f"{cfg.float8.moe_recipe_name} routed experts" + (" (emulated)" if cfg.float8.emulate else ""))
    if cfg.compile.enable:
        extras.append(f"compiled ({cfg.compile.backend})")
    if cfg.activation_checkpoint.mode != "none":
        extras.append(f"{cfg.activation_checkpoint.mode} activation checkpointing")
    mesh = f"mesh {dims.layout()} on {dims.world_size} processes" if dims.world_size > 1 else "1 process"
    params = f"{n_params / 1e6:,.2f}M parameters" + (f" ({active / 1e6:,.2f}M active a token)" * (active < n_params))
    return f"{cfg.model.name} {cfg.model.flavor}: {params}, {mesh}, {', '.join(extras)}"


def _data(cfg: JobConfig, dims: ParallelDims, global_batch: int) -> str:
    t, m = cfg.training, cfg.mixture
    if t.dataset == "mixture":
        weights = mixture_phases(cfg)[0][1]  # the first phase's: the sources' own, or --mixture.weights'
        total = sum(weights.values()) or 1
        data = "mixture of " + ", ".join(f"{name} {w / total:.0%}" for name, w in weights.items())
        data += f" ({len(m.phases)} later phase{'s' * (len(m.phases) != 1)})" if m.phases else ""
    else:
        data = " ".join(filter(None, (t.dataset, t.dataset_path)))
    ft = cfg.fault_tolerance
    groups = ft.group_size if ft.enable else 1  # all alive; fewer take more micro-batches each (replicas.py)
    rows = global_batch // (t.local_batch_size * dims.dp)  # of a micro-batch on each rank of a group
    micro, more = divmod(rows, groups)  # uneven shares: the first `more` groups take one more (loader.group_share)
    line = (f"data {data}: {t.steps:,} step{'s' * (t.steps != 1)} of {global_batch} x {t.seq_len} = "
            f"{global_batch * t.seq_len:,} tokens ({t.local_batch_size} sequence{'s' * (t.local_batch_size != 1)} a "
            f"rank per micro-batch, "
            f"{f'{micro} or {micro + 1}' if more else micro} micro-batch{'es' * (rows > groups)}")
    if ft.enable:
        line += (f" each, with all {groups} replica groups alive" if ft.mode == "exact" else
                 f" each in each of the {groups} replica groups; a missing group's are skipped: fault_tolerance.mode "
                 "fast")
    return line + ")"


def _outputs(cfg: JobConfig) -> tuple[str, list[str], str, str]:
    """(the outputs line, warnings about the folder, the nothing-to-do line, the checkpoint folder)."""
    ck, folder = cfg.checkpoint, os.path.abspath(cfg.job.dump_folder)
    written = ["metrics.jsonl", "config.toml"]
    written += [f"{cfg.metrics.save_tb_folder}/"] * cfg.metrics.enable_tensorboard
    written += [f"{cfg.profiling.save_traces_folder}/"] * cfg.profiling.enable_profiling
    line = f"outputs in {folder}: {', '.join(written)}"
    checkpoints = os.path.join(folder, ck.folder)
    if not ck.enable:
        if not (found := complete_checkpoints(checkpoints)):
            return line + "; checkpoints off", [], "", ""
        newest = max(found)
        run = f" of run {r}" if (r := read_run_files(found[newest])[0]) else ""
        return line + "; checkpoints off", [
            f"{checkpoints} holds {_steps(list(found))}{run}: checkpoint.enable is off, so this run starts afresh and "
            f"leaves them as they are (with --checkpoint.enable it would resume step-{newest})"], "", ""
    if ck.create_seed_checkpoint:
        return line + f"; a seed checkpoint (step-0) in {checkpoints}", [], "", checkpoints
    line += f"; checkpoints every {ck.interval} steps in {checkpoints}" + (
        " (the last also as a Hugging Face folder, step-N-hf)" if ck.last_save_in_hf else "")
    step, found, initial = checkpoint_to_load(ck, checkpoints)
    if step is None:
        hf = " (a Hugging Face folder)" if ck.initial_load_in_hf else ""
        return line + (f", starting from {initial}{hf}" if initial else ", starting afresh"), [], "", checkpoints
    run = f" of run {r}" if (r := read_run_files(found[step])[0]) else ""
    if step >= cfg.training.steps:
        return line, [], (f"the checkpoint {found[step]} is at step {step} and training.steps is "
                          f"{cfg.training.steps}: nothing to do (raise training.steps to extend the run)"), checkpoints
    return line + f", resuming step-{step}{run}", [], "", checkpoints


def hf_export(cfg: JobConfig, spec: ModelSpec, model_args: Args) -> str:
    """The warning for a model whose Hugging Face export would refuse it, or "": the spec's adapter builds the export's
    config.json, which names what the layout cannot hold (models/*/hf.py), as it would after training. A run whose
    last save is that export is refused instead (checkpoint/hf_load.check_hf)."""
    if spec.hf is None or cfg.checkpoint.last_save_in_hf:
        return ""
    try:
        spec.hf.config(model_args, 0, 0, torch.float32)
    except ConversionError as e:
        return f"the Hugging Face export (scripts/convert_to_hf.py) will refuse this run's checkpoints: {e}"
    return ""


def slow_step(cfg: JobConfig, token_flops: float, global_batch: int, world_size: int, peak: tuple[float, str]) -> str:
    """The warning for a first step that needs more than SLOW_STEP_S at `peak` (FLOP/s of one process, and what it
    is), or "". `token_flops`: the model's training FLOPs per token (its spec's flops_per_token)."""
    t = cfg.training
    flops = token_flops * global_batch * t.seq_len / world_size
    seconds, rate = flops / peak[0], peak[1].split(", measured")[0]  # what the peak is, not where it is kept
    if seconds < SLOW_STEP_S:
        return ""
    return (f"each step needs {flops / 1e12:,.1f} TFLOP per process, at least {_duration(seconds)} at the {rate} "
            f"and several times that in practice: the first step will not finish soon ({t.steps:,} steps: at least "
            f"{_duration(seconds * t.steps)}); on a CPU, start from train_configs/debug_model.toml, or lower "
            "training.local_batch_size and seq_len"
            + (" and use training.mixed_precision_param float32" if t.mixed_precision_param != "float32" else ""))


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:,.0f} {unit}"
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def machine_plan(cfg: JobConfig, preflighted: tuple, local_processes: int) -> Plan:
    """The plan of a run preflight() passed, on this machine with `local_processes` processes: on a CPU, its slow
    step is judged at the matmul peak of one of them, which share the cores."""
    dims, model_args, _, global_batch, _, _ = preflighted
    peak = None if torch.cuda.is_available() else lambda dtype: cpu_peak(dtype, cpu_threads(local_processes))
    return make_plan(cfg, dims, model_args, global_batch, peak)


def make_plan(cfg: JobConfig, dims: ParallelDims, model_args: Args, global_batch: int, peak=None) -> Plan:
    """The run's plan; `peak(dtype) -> (FLOP/s of one process, what it is)` on a machine without a GPU."""
    spec = registry.get(cfg.model.name)
    with torch.device("meta"):
        model = spec.model_class(model_args)
    n_params = sum(p.numel() for p in model.parameters())
    outputs, warnings, done, checkpoints = _outputs(cfg)
    plan = Plan([_model(cfg, n_params, n_params - inactive_params(model), dims), _data(cfg, dims, global_batch),
                 outputs], warnings, done, checkpoints)
    if (warmup := cfg.lr_scheduler.warmup_steps) > cfg.training.steps:
        plan.warnings.append(f"lr_scheduler.warmup_steps {warmup} is more than training.steps {cfg.training.steps}: "
                             f"the warmup is cut to the run's {cfg.training.steps} steps (the lr reaches its peak at "
                             "the last step); set warmup_steps to what the run should warm up over")
    if cfg.training.layout_invariant:
        plan.lines.append(layout_invariant.COST)
    if cfg.training.layout_invariant_cp > 1:
        plan.lines.append(layout_invariant.COST_CP)
    if export := hf_export(cfg, spec, model_args):
        plan.warnings.append(export)
    if peak is not None and not done:
        dtype = Numerics.from_config(cfg, dims).compute_dtype
        token_flops = spec.flops_per_token(model, cfg.training.seq_len)
        if slow := slow_step(cfg, token_flops, global_batch, dims.world_size, peak(dtype)):
            plan.warnings.append(slow)
    return plan


def ending(cfg: JobConfig, first_step: int, last_step: int, seconds: float, logged: dict, writes: bool = True) -> str:
    """The run's last line: how far it got, its last logged loss (and validation loss), its time, and where each
    output went. `logged`: the last logged step's values (MetricLogger.last); `writes`: whether this job saves the
    run's checkpoints (of replica groups, only the writing group does)."""
    t, folder = cfg.training, os.path.abspath(cfg.job.dump_folder)
    trained = last_step - first_step + 1
    line = (f"training {'done' if last_step >= t.steps else 'stopped'} at step {last_step}/{t.steps}: {trained} step"
            f"{'s' * (trained != 1)} in {_duration(seconds)} by this run")
    if "loss" in logged:
        line += f"; loss {logged['loss']:.4f} at step {logged['step']}"
        line += f", val_loss {logged['val_loss']:.4f}" if "val_loss" in logged else ""
    outputs = [f"metrics in {os.path.join(folder, 'metrics.jsonl')}"]
    checkpoints = os.path.join(folder, cfg.checkpoint.folder)
    if cfg.checkpoint.enable and not writes:
        # Every ending saves its last step, and the writing group may be saving it still: listed now, the folder's
        # newest would be an older one.
        outputs.append(f"checkpoint {os.path.join(checkpoints, f'step-{last_step}')} (the writing replica group's)")
    elif cfg.checkpoint.enable and (found := complete_checkpoints(checkpoints)):
        outputs.append(f"checkpoint {found[max(found)]}")  # this job's own save is complete: it closed it
    if cfg.metrics.enable_tensorboard:
        outputs.append(f"TensorBoard in {os.path.join(folder, cfg.metrics.save_tb_folder)}")
    if cfg.profiling.enable_profiling:
        outputs.append(f"traces in {os.path.join(folder, cfg.profiling.save_traces_folder)}")
    outputs.append(f"plot: python scripts/plot_metrics.py {folder} --out curves.png")
    return f"{line}; {'; '.join(outputs)}"
