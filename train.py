"""Pretrain a Llama model with PyTorch-native parallelism (PP + TP + CP + FSDP2/HSDP), configured by a TOML file.

Launch (one node, 8 GPUs or 4 CPU processes):
    NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh --training.steps 100
    torchrun --standalone --nproc_per_node 4 train.py --job.config_file train_configs/debug_model.toml
Multi-node: the same command on every node with a c10d rendezvous (see multinode_trainer.slurm):
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 train.py --job.config_file F
Any config key can be overridden as --section.key value; `python train.py --help` lists them all.
`WORLD_SIZE=N python train.py --check --job.config_file F [overrides]` only validates a config for N processes
(`--check` may come anywhere; `./run_train.sh ... --check` does the same for NGPU).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from torchtitan_lite.checkpoint.manager import CheckpointManager, CheckpointSaveError, TrainState
from torchtitan_lite.config import ConfigError, JobConfig, load_config, to_toml
from torchtitan_lite.data.loader import DataLoader, warn_if_validating_on_training_data
from torchtitan_lite.models import documents, registry
from torchtitan_lite.models.spec import Args, ModelSpec
from torchtitan_lite.parallel.context_parallel import sharder
from torchtitan_lite.parallel.cp_blocks import stacked
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.parallelize import parallelize, warn_ignored_options
from torchtitan_lite.parallel.pipeline import merge_stages, split_stages
from torchtitan_lite.parallel.stage_ties import StageTies
from torchtitan_lite.quantization import float8, mxfp8_experts
from torchtitan_lite.runtime import flight_recorder, run_lock, startup_interrupt
from torchtitan_lite.runtime.fence import file_state
from torchtitan_lite.runtime.errors import checks_passed, group_formed, report
from torchtitan_lite.runtime.memory_snapshot import MemorySnapshots, OutOfMemory
from torchtitan_lite.runtime.memory_use import MemoryUse
from torchtitan_lite.runtime.metric_logger import MetricLogger
from torchtitan_lite.runtime.metrics import FLOAT8, stated_peak_flops
from torchtitan_lite.runtime.phases import Phases
from torchtitan_lite.runtime.precision import NonFiniteError, UpdateGuard, warn_if_slow
from torchtitan_lite.runtime.process import Env, init_distributed, peer_timeout, set_determinism, set_timeout
from torchtitan_lite.runtime.profiling import StepProfiler
from torchtitan_lite.runtime.run_history import history_run, start_history
from torchtitan_lite.runtime.signals import Preemption, exit_code, restore_signals, stop_with_launcher
from torchtitan_lite.runtime.stragglers import Stragglers
from torchtitan_lite.runtime.throughput import Throughput
from torchtitan_lite.training import layout_invariant
from torchtitan_lite.training.expert_load import ExpertLoad
from torchtitan_lite.training.optim import build_lr_scheduler, clip_grad_norm_
from torchtitan_lite.training.optimizers import build_optimizer
from torchtitan_lite.training.plan import ending, machine_plan
from torchtitan_lite.training.preflight import preflight
from torchtitan_lite.training.replicas import NoReplicas, Replicas, build_replicas
from torchtitan_lite.training.source_losses import SourceLosses
from torchtitan_lite.training.mtp import MTP
from torchtitan_lite.training.step import Inputs, Numerics, build_step
from torchtitan_lite.training.steps import Steps
from torchtitan_lite.training.update import Update
from torchtitan_lite.training.validation import Validation
from torchtitan_lite.tools.hf_convert import export_last_save

logger = logging.getLogger("torchtitan_lite")


# run_train.sh sets it once its `--check` has printed the plan, so that rank 0 does not print it again.
PLAN_SHOWN = "TORCHTITAN_LITE_PLAN_SHOWN"


def start_processes(cfg: JobConfig, env: Env, dims: ParallelDims):
    """The process group, this rank's device and the mesh: (device, mesh, dp mesh, loss mesh)."""
    checks_passed(env)  # from here on, errors are decided on rank 0 and raised on every rank
    flight_recorder.enable(cfg.comm.trace_buf_size, cfg.job.dump_folder)
    ft = cfg.fault_tolerance
    device = init_distributed(env, cfg.comm.init_timeout_seconds, ft.groups_per_machine if ft.enable else 1)
    group_formed(env)  # a line can now be said for a hung rank 0
    set_determinism(cfg.training.seed, cfg.training.deterministic, device, cfg.training.layout_invariant)
    mesh, dp_mesh, loss_mesh = dims.build_mesh(device.type)
    if env.rank == 0 and cfg.job.print_args:
        logger.info("resolved config:\n%s", to_toml(cfg))
    return device, mesh, dp_mesh, loss_mesh


def build_model(cfg: JobConfig, model_args: Args, mesh, dims: ParallelDims, device: torch.device):
    """The model of `model.name`'s spec built on meta (no memory), cut into this rank's pipeline stages, parallelized,
    then materialized shard by shard: on the host under CPU offload, where FSDP keeps the shards (it copies to the
    device only what it gathers), with the buffers on the device. Returns (this rank's parameters under their
    full-model names, its stages, the full model's training FLOPs per token)."""
    spec = registry.get(cfg.model.name)
    init_device = torch.device("cpu") if dims.fsdp and cfg.parallelism.fsdp_cpu_offload else device
    with torch.device("meta"):
        model = spec.model_class(model_args)
    token_flops = spec.flops_per_token(model, cfg.training.seq_len)
    parts = ([model] if dims.pp == 1 else
             split_stages(spec.model_class, model_args, mesh["pp"].get_local_rank(), cfg.parallelism))
    warn_ignored_options(cfg, dims)
    for part in parts:
        if float8.enabled(cfg):
            float8.convert(part, cfg, dims.fsdp)
        if mxfp8_experts.enabled(cfg):
            mxfp8_experts.convert(part, cfg)
        parallelize(part, mesh, dims, cfg, spec.tp_plan)
        part.to_empty(device=init_device)
        part.init_weights(seed=cfg.training.seed, buffer_device=device)
        part.train()
    # One module for the optimizer, the norm and the checkpoint; under PP it is never run itself.
    return merge_stages(parts), parts, token_flops


def begin_history(cfg: JobConfig, env: Env, checkpoint: CheckpointManager, resumed: int) -> None:
    """Makes the folder's history this run's (run_history.py); rank 0, before the run's first record."""
    its_run, its_config = checkpoint.resumed_run
    run_id = start_history(cfg.job.dump_folder, resumed, its_run, to_toml(cfg), cfg.metrics.save_tb_folder,
                           env.world_size, its_config)
    checkpoint.run = (run_id, to_toml(cfg))  # every checkpoint says whose it is and the config that wrote it
    logger.info("run %s%s", run_id, f", resumed after step {resumed}" if resumed else "")


def adopt_history(cfg: JobConfig, checkpoint: CheckpointManager) -> None:
    """Labels this job's checkpoints with the run another replica group began; rank 0, once it saves them."""
    checkpoint.run = (history_run(cfg.job.dump_folder), to_toml(cfg))


@dataclass
class Trainer:
    """What the loop works with, set up by setup(): each part owns its concern and the fields it logs."""
    steps: Steps  # the steps to train, and what happens between two (gc, signals, the profiler's step)
    phase: Phases  # names a part of the step for the profiler's trace and a hang's error line at once
    data: DataLoader
    stragglers: Stragglers  # times the data wait; the slowest rank at each logging step
    per_source: SourceLosses  # the step's forward and backward, with a mixture's per-source losses
    update: Update  # the optimizer step and everything around it
    replicas: NoReplicas | Replicas  # replica groups: who is alive, their gradients summed, each step committed
    validation: Validation
    throughput: Throughput  # tokens/s and MFU, validation left out
    memory: MemoryUse
    train_state: TrainState
    guard: UpdateGuard  # steps whose gradients are not finite
    expert_load: ExpertLoad  # a mixture of experts' load each step, and its bias balancing
    metrics: MetricLogger
    loss_group: dist.ProcessGroup  # where the logged loss is all-reduced
    checkpoint: CheckpointManager


def setup(cfg: JobConfig, env: Env, exits: contextlib.ExitStack) -> Trainer | None:
    """The run up to its first step, in the order it must be built; None when it has nothing to train (its
    checkpoint is at training.steps, or it writes a seed checkpoint). `exits` closes what it opens (run())."""
    preflighted = preflight(cfg, env.world_size)
    dims, model_args, bos_id, global_batch, source, val_sources = preflighted
    training = cfg.training
    if env.rank == 0:
        # One live run per folder, before anything is written (replica groups share it: runtime/run_lock.py).
        exits.enter_context(run_lock.hold(cfg.job.dump_folder, shared=cfg.fault_tolerance.enable))
        if not os.environ.get(PLAN_SHOWN):
            machine_plan(cfg, preflighted, env.local_world_size).say()
    warn_if_validating_on_training_data(training, cfg.validation)

    device, mesh, dp_mesh, loss_mesh = start_processes(cfg, env, dims)
    built = time.perf_counter()
    leaf = layout_invariant.leaf_size(cfg, dims)
    # This rank's part of every sequence under CP, else CP 2's halves stacked (training.layout_invariant_cp 2).
    seq_share = sharder(mesh["cp"], training.seq_len, cfg.parallelism.context_parallel_load_balancer) or stacked(
        cfg, dims.cp, leaf)
    # What the model gets beside the tokens (block_causal: document ids; multi-token prediction: its depths' tokens;
    # both known before CP cuts the windows).
    inputs, seq_share = Inputs.build(bos_id, seq_share, MTP.from_config(model_args, training.mtp_weight))
    # The training data, and the held-out data read anew from its start at every validation.
    loader_args = (global_batch, training.local_batch_size, dp_mesh.get_local_rank(), dims.dp, seq_share,
                   device.type == "cuda")
    data = DataLoader(source, *loader_args, interleave=leaf)
    model, parts, model_flops_per_token = build_model(cfg, model_args, mesh, dims, device)
    # block_causal: FlexAttention's block mask on a GPU, else an explicit mask.
    documents.use_kernel(parts, device.type, dims.cp, masked=bos_id is not None)
    if not cfg.compile.enable:
        flight_recorder.mark_blocks(parts)  # a hang then names the block whose forward it stalled in
    params = list(model.parameters())
    logger.info("model built, parallelized and initialized in %.1fs", time.perf_counter() - built)
    if cfg.compile.enable:
        logger.info("the first step compiles each block (%s): it takes far longer than the others",
                    cfg.compile.backend)
    # On the host under CPU offload; the spec says which parameters are matrices (Muon's).
    optimizer = build_optimizer(model, cfg, params[0].device.type, registry.get(cfg.model.name).param_group)
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, training.steps)

    # ---- The step: forward, loss and backward over the micro-batches (step.py), the pipeline's under PP.
    global_tokens = global_batch * training.seq_len
    numerics = Numerics.from_config(cfg, dims)
    warn_if_slow(device, numerics.compute_dtype)
    guard = UpdateGuard(device, numerics.compute_dtype, training.skip_nonfinite_steps)
    leaves = (loss_mesh if dims.cp > 1 else dp_mesh).get_group()  # the ranks holding leaves' losses (the mode's)
    model_step = build_step(model, parts, mesh, dims, cfg, device, numerics, guard.scale, inputs, leaves)
    # MFU against the peak of the units the blocks' matmuls run on: float8's when converted and not emulated, its
    # attention and output layer counted against it too (torchtitan reports none under float8; docs/float8.md).
    peak, peak_said = stated_peak_flops(device, FLOAT8 if float8.enabled(cfg) and not cfg.float8.emulate
                                        else numerics.compute_dtype)
    logger.info("mfu against the %s", peak_said)

    # ---- Checkpoint: resume from the newest complete checkpoint in the folder, or start from
    # checkpoint.initial_load_path.
    train_state = TrainState()
    history_found = file_state(cfg.job.dump_folder)  # replica groups: whether another group logs meanwhile
    # Closed on every way out: an in-flight async save is published or, failed, cleared; old ones finish deleting.
    checkpoint = exits.enter_context(CheckpointManager(cfg.checkpoint, cfg.job.dump_folder, model, optimizer,
                                                       scheduler, data, train_state, guard, training.steps,
                                                       cfg.model.name))
    resumed = 0 if cfg.checkpoint.create_seed_checkpoint else checkpoint.load()
    if train_state.step >= training.steps:
        logger.info("the checkpoint is at step %d, training.steps is %d: nothing to do (raise training.steps to "
                    "extend the run)", train_state.step, training.steps)
        return None
    # The folder's history (metrics.jsonl, config.toml, tb/) becomes this run's, decided once the checkpoint it
    # starts from is known and before anything is written: a resume continues its run's, a fresh start begins one.
    # A plain run decides now; replica groups at their first committed step, in the group that logs it (replicas.py).
    history = partial(begin_history, cfg, env, checkpoint, resumed) if env.rank == 0 else lambda: None
    adopt = partial(adopt_history, cfg, checkpoint) if env.rank == 0 else lambda: None
    # Agreeing on a signal takes a collective: on the CPU, so it overlaps GPU work (gloo is the CPU's default group).
    # So does the stragglers' gather of step times at logging steps.
    host_group = dist.new_group(backend="gloo") if device.type == "cuda" else None
    preemption = Preemption(host_group, saving=cfg.checkpoint.enable, speak=env.rank == 0)
    # Replica groups: the first quorum, where a group that restarts loads a live group's state and step.
    replicas = build_replicas(cfg, env.rank, env.world_size, dp_mesh.get_local_rank(), dims.dp, data,
                              checkpoint.states, train_state, params, preemption, exits, history_found)
    replicas.join(history, adopt)
    checkpoint.writer = replicas.writer
    if cfg.checkpoint.create_seed_checkpoint:
        checkpoint.save(0, model_only=True)
        checkpoint.close()  # an async save is written only now
        logger.info("seed checkpoint written: runs on any mesh with this checkpoint folder start from it")
        return None

    # ---- Around the step: what it logs, what traces it, what acts around its update and between steps.
    metrics = MetricLogger(cfg.job.dump_folder, env.rank, cfg.metrics.log_freq, cfg.metrics.enable_tensorboard,
                           cfg.metrics.save_tb_folder, start_step=train_state.step, total_steps=training.steps,
                           config=to_toml(cfg), enable_wandb=cfg.metrics.enable_wandb, writes=replicas.writer.holds,
                           unwritten=replicas.unwritten)
    # Traces of chosen steps and, on a GPU, memory snapshots (one written when a step runs out of memory).
    profiler = exits.enter_context(StepProfiler(cfg.profiling, cfg.job.dump_folder, env.rank, device, train_state.step))
    snapshots = exits.enter_context(MemorySnapshots(cfg.profiling, cfg.job.dump_folder, env.rank, device,
                                                    cfg.job.config_file))
    # FSDP's float8 all-gather with precomputed scales: the weights' scales, before the first step and each later one.
    float8_scales = float8.ScalePrecompute(cfg, dims.fsdp, parts)
    float8_scales()
    memory = MemoryUse(device)
    # Parameters the first and last pipeline stages share (tied embeddings) get both stages' gradients before the clip.
    clip = StageTies(parts, mesh).clip if dims.pp > 1 else lambda clip: clip
    update = Update(optimizer, scheduler, guard, clip(partial(clip_grad_norm_, params, training.max_norm,
                                                              env.world_size, in_float32=training.layout_invariant)),
                    commit=replicas.commit)
    stages = mesh["pp"].get_group() if dims.pp > 1 and ModelSpec.moe(model_args) is not None else None
    expert_load = ExpertLoad(model, lambda: dims.token_mesh(mesh).get_group() if dims.dp * dims.cp * dims.tp > 1
                             else None, global_batch, stages, device, training.seq_len)
    update.after_step += [float8_scales, expert_load, partial(train_state.advance, global_tokens)]
    # The bytes held for state, measured after the first step's backward and update (go in the next record); and
    # start-up is over: a peer silent for train_timeout_seconds from now on is hung.
    update.after_first_step += [partial(memory.measure_held, model, optimizer),
                                partial(set_timeout, cfg.comm.train_timeout_seconds)]
    phase = Phases(profiler)
    return Trainer(
        steps=Steps(train_state.step, training.steps, training.gc_freq, preemption, profiler, snapshots, phase,
                    checkpoint),
        phase=phase, data=data, stragglers=Stragglers(host_group, cfg.metrics.straggler_factor),
        per_source=SourceLosses(data, model_step, training.seq_len, global_tokens), update=update, replicas=replicas,
        validation=Validation(cfg.validation, val_sources, loader_args, model_step, global_tokens,
                              loss_mesh.get_group(), training.steps),
        throughput=Throughput(global_tokens, env.world_size, model_flops_per_token, peak, train_state.step,
                              replicas.batches_trained),
        memory=memory, train_state=train_state, guard=guard, expert_load=expert_load, metrics=metrics,
        loss_group=loss_mesh.get_group(), checkpoint=checkpoint)


def main(cfg: JobConfig, env: Env, exits: contextlib.ExitStack) -> str | None:
    """Trains; `exits` closes what main opens on every way out (run()). Returns the signal that stopped it early."""
    t = setup(cfg, env, exits)
    if t is None:
        return None
    for step in t.steps:  # and between two steps: gc, the agreement on signals, the profiler's step (steps.py)
        last = step == t.steps.last
        logging_step = t.metrics.should_log(step, last=last)
        grad_norm = None
        for _ in t.replicas.attempts(step):  # once; with replica groups, until every live group commits the step
            with t.phase("data"):
                batches = t.stragglers.timed_data(t.data.next_batch)
            with t.phase("forward_backward"):
                # The step's loss, then a mixture's per-source sums at logging steps: one all-reduce for all of them.
                losses = t.per_source.train_step(batches, logging_step)
                t.replicas.reduce(losses)  # summed across replica groups, with the gradients
            with t.phase("optimizer"):
                grad_norm = t.update(step)  # skipped when a voter says so (a gradient inf/NaN), decided on the device
        if grad_norm is None:
            continue  # healed from a replica group that committed this step
        val_losses = {}
        if t.validation.due(step):
            with t.phase("validation"), t.throughput.paused():  # tokens/s and MFU measure training alone
                val_losses = t.validation()
        if logging_step or val_losses:
            with t.phase("log"):
                t.guard.check()  # a step since the last log that must stop the run raises here (saves check too)
                dist.all_reduce(losses, group=t.loss_group)
                losses, window = losses.tolist(), t.throughput.lap(step)
                t.metrics.log(step, {
                    "loss": losses[0], "grad_norm": grad_norm.item(), **t.update.fields(), **window.fields(),
                    **t.memory.fields(), **t.train_state.fields(),
                    "world_size": env.world_size,  # changes when an elastic job shrinks or grows
                    **t.guard.metrics(), **t.stragglers.fields(window.seconds, window.steps), **val_losses,
                    **t.expert_load.fields(), **t.replicas.fields(),
                    **t.per_source.fields(losses, step),
                })
        with t.phase("checkpoint"):
            t.checkpoint.maybe_save(step, last=last)
    t.guard.check()  # a preempted run may stop between logging steps
    t.replicas.finish()
    t.checkpoint.close()  # waits for an async save still being written
    t.metrics.close()
    if cfg.checkpoint.last_save_in_hf and env.rank == 0 and t.steps.stopped is None and t.replicas.writer.holds():
        export_last_save(cfg, t.train_state.step)  # every rank has saved (close's barrier): one process converts
    if env.rank == 0:
        logger.info("%s", ending(cfg, t.steps.first, t.steps.done, t.steps.seconds(), t.metrics.last,
                                 t.replicas.writer.holds()))
    return t.steps.stopped


def checked(cfg: JobConfig, world_size: int) -> None:
    """`--check`: the trainer's checks for `world_size` local processes, then the plan printed. For run_train.sh,
    also written to the file TORCHTITAN_LITE_PLAN_FILE names, as the lines `dump_folder=PATH`,
    `checkpoint_folder=PATH` (empty with checkpointing off), `nothing_to_do=0|1` and `shared_lock=0|1` (replica
    groups share the folder's lock), which it reads."""
    # First: a folder in use is the answer, whatever else the config says.
    run_lock.check_free(cfg.job.dump_folder, cfg.fault_tolerance.enable)
    preflighted = preflight(cfg, world_size)
    plan = machine_plan(cfg, preflighted, world_size)  # run_train.sh starts every process on this machine
    print("\n".join(plan.lines + [f"warning: {w}" for w in plan.warnings] + [plan.nothing_to_do] * bool(
        plan.nothing_to_do)), flush=True)
    if path := os.environ.get("TORCHTITAN_LITE_PLAN_FILE"):
        with open(path, "w") as f:
            f.write(f"dump_folder={os.path.abspath(cfg.job.dump_folder)}\ncheckpoint_folder={plan.checkpoint_folder}\n"
                    f"nothing_to_do={int(bool(plan.nothing_to_do))}\nshared_lock={int(cfg.fault_tolerance.enable)}\n")


def run(argv: list[str] | None = None, check: bool = False) -> int:
    """Trains; with `check`, only validates the config for WORLD_SIZE processes (exit 2 and one line if it is bad)."""
    env, stopped, collecting, threads = Env.from_environ(), None, gc.isenabled(), torch.get_num_threads()
    stop_with_launcher()
    # A check prints its plan and what warns; the job it precedes logs the rest of what it reads.
    logging.basicConfig(level=logging.WARNING if check else logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    try:
        if not check:  # run_train.sh's check ignores Ctrl-C: the script stops once it has ended
            startup_interrupt.heed()  # in here: Ctrl-C from this moment on (or passed on before it) stops start-up
        cfg = load_config(argv)
        if check:
            checked(cfg, env.world_size)
        else:
            with contextlib.ExitStack() as exits:
                stopped = main(cfg, env, exits)
    except ConfigError as e:
        report(e, env)  # one line for the whole job, printed before any rank exits
        return 2
    except (NonFiniteError, CheckpointSaveError) as e:  # raised on every rank at the same step
        report(e, env)
        return 1
    except OutOfMemory as e:  # its snapshot written (memory_snapshot.py)
        report(e, env)
        return 1
    except RuntimeError as e:
        if (timeout := peer_timeout(e)) is None:
            raise
        report(flight_recorder.explain(timeout, env), env)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the loop, which handles it: start-up stops, as start-up should
        if env.rank == 0:
            logger.warning("Ctrl-C during start-up: stopped before the first step, nothing saved")
        return exit_code("SIGINT")
    finally:
        # main() may have turned automatic collection off: the caller gets back what it had (turned on in a process
        # started with it off, as the suite's are, its first collection walks every object torch made: 0.17 s)
        if collecting:
            gc.enable()
        if torch.get_num_threads() != threads:  # as main() found it (training.layout_invariant computes with one)
            torch.set_num_threads(threads)
        restore_signals()
        if dist.is_initialized():
            dist.destroy_process_group()
    return exit_code(stopped)


if __name__ == "__main__":
    faulthandler.enable()  # a crash in native code (gloo, a kernel) still names the Python line it came from
    check = "--check" in sys.argv[1:]  # anywhere among the arguments: a user appends it to a command that trains
    code = run([a for a in sys.argv[1:] if a != "--check"], check=check)
    gc.freeze()  # no final garbage collection over torch's objects at exit: about a second less per rank
    sys.exit(code)
