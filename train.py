"""Pretrain a Llama model with PyTorch-native parallelism (PP + TP + CP + FSDP2/HSDP), configured by a TOML file.

Launch (one node, 8 GPUs or 4 CPU processes):
    NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh --training.steps 100
    torchrun --standalone --nproc_per_node 4 train.py --job.config_file train_configs/debug_model.toml
Multi-node: the same command on every node with a c10d rendezvous (see multinode_trainer.slurm):
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 train.py --job.config_file F
Any config key can be overridden as --section.key value; `python train.py --help` lists them all.
`WORLD_SIZE=N python train.py --check --job.config_file F [overrides]` only validates a config for N processes.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan_lite.checkpoint.manager import CheckpointManager, CheckpointSaveError, TrainState, check_config
from torchtitan_lite.config import ConfigError, JobConfig, load_config, to_toml
from torchtitan_lite.data.loader import DataLoader, build_sources, to_device, warn_if_validating_on_training_data
from torchtitan_lite.data.tokenizer import load_tokenizer
from torchtitan_lite.models.llama import Transformer, count_params, flavor_args
from torchtitan_lite.parallel.context_parallel import check_cp, sharder
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.parallelize import parallelize, warn_ignored_options
from torchtitan_lite.parallel.pipeline import Pipeline, check_pipeline, merge, split
from torchtitan_lite.runtime.errors import checks_passed, group_formed, report
from torchtitan_lite.runtime.metrics import MetricLogger, flops_per_token, held_bytes, memory_gib, peak_flops
from torchtitan_lite.runtime.precision import DTYPES, NonFiniteError, UpdateGuard, warn_if_slow
from torchtitan_lite.runtime.process import Env, init_distributed, peer_timeout, set_determinism, set_timeout
from torchtitan_lite.runtime.run_history import start_history
from torchtitan_lite.runtime.signals import Preemption, exit_code, restore_signals, stop_with_launcher
from torchtitan_lite.training.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_

logger = logging.getLogger("torchtitan_lite")


def preflight(cfg: JobConfig, world_size: int):
    """Everything that can be checked before any process talks to another, so a bad config fails on every rank the
    same way instead of hanging in a collective; `train.py --check` runs it alone (run_train.sh, before torchrun)."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    model_args = flavor_args(cfg.model.flavor, tokenizer.n_words, cfg.training.seq_len)
    dims.validate_model(model_args)
    if dims.pp > 1:
        check_pipeline(cfg.parallelism, model_args.n_layers, cfg.training.local_batch_size)
    if dims.cp > 1:
        check_cp(cfg.training.seq_len, dims.cp, dims.tp, cfg.parallelism.context_parallel_load_balancer)
    check_config(cfg.checkpoint, world_size, cfg.job.dump_folder)
    t, v = cfg.training, cfg.validation
    global_batch = dims.global_batch(t.local_batch_size, t.global_batch_size)
    source, val_source = build_sources(t, v, tokenizer)
    return dims, model_args, global_batch, source, val_source


def summary(cfg: JobConfig, n_params: int, mesh, global_batch: int) -> str:
    """The run in the one line the console shows at start-up; config.toml holds the rest (job.print_args shows it)."""
    t = cfg.training
    layout = " x ".join(f"{name} {size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape) if size > 1)
    data = " ".join(filter(None, (t.dataset, t.dataset_path)))
    return (f"{cfg.model.name} {cfg.model.flavor}: {n_params / 1e6:.2f}M parameters, mesh {layout or '1 process'}, "
            f"data {data}, {t.steps} step{'s' * (t.steps != 1)} of {global_batch} x {t.seq_len} tokens, "
            f"outputs in {os.path.abspath(cfg.job.dump_folder)}")


def main(cfg: JobConfig, env: Env, exits: contextlib.ExitStack) -> str | None:
    """Trains; `exits` closes what main opens on every way out (run()). Returns the signal that stopped it early."""
    dims, model_args, global_batch, source, val_source = preflight(cfg, env.world_size)
    t, v = cfg.training, cfg.validation
    warn_if_validating_on_training_data(t, v)  # here, not in preflight: a --check says nothing of a legal config

    # ---- Processes, device, mesh.
    checks_passed(env)  # from here on, errors are decided on rank 0 and raised on every rank
    device = init_distributed(env, cfg.comm.init_timeout_seconds)
    group_formed(env)  # a line can now be said for a hung rank 0
    set_determinism(t.seed, t.deterministic, device)
    mesh, dp_mesh, loss_mesh = dims.build_mesh(device.type)
    if env.rank == 0 and cfg.job.print_args:
        logger.info("resolved config:\n%s", to_toml(cfg))
    seq_share = sharder(mesh["cp"], t.seq_len, cfg.parallelism.context_parallel_load_balancer)
    pin = device.type == "cuda"
    data = DataLoader(source, global_batch, t.local_batch_size, dp_mesh.get_local_rank(), dims.dp, seq_share, pin)

    # ---- Model: built on meta (no memory), cut into this rank's pipeline stages, parallelized, then materialized
    # shard by shard: on the host under CPU offload, where FSDP keeps the shards (it copies to the device only what
    # it gathers), with the buffers on the device.
    init_device = torch.device("cpu") if dims.fsdp and cfg.parallelism.fsdp_cpu_offload else device
    with torch.device("meta"):
        model = Transformer(model_args)
    n_params, n_embedding = count_params(model)
    parts = split(model_args, mesh["pp"].get_local_rank(), cfg.parallelism) if dims.pp > 1 else [model]
    warn_ignored_options(cfg, dims)
    for part in parts:
        parallelize(part, mesh, dims, cfg)
        part.to_empty(device=init_device)
        part.init_weights(seed=t.seed, buffer_device=device)
        part.train()
    model = merge(parts)  # this rank's parameters under their full-model names: optimizer, norm, checkpoint
    params = list(model.parameters())
    logger.info(summary(cfg, n_params, mesh, global_batch))

    optimizer = build_optimizer(model, cfg.optimizer, params[0].device.type)  # on the host under CPU offload
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, t.steps)

    # ---- Numerics of the step. The loss is a sum of token losses over the global token count, and gradients are
    # summed across ranks (parallelize.py), so accumulation and data parallelism give one big batch's gradient.
    global_tokens = global_batch * t.seq_len
    use_loss_parallel = dims.tp > 1 and not cfg.parallelism.disable_loss_parallel
    compute_dtype = DTYPES[t.mixed_precision_param]
    # FSDP applies mixed precision itself; without it (1 process, TP only) autocast does.
    autocast = not dims.fsdp and compute_dtype != torch.float32
    warn_if_slow(device, compute_dtype)
    guard = UpdateGuard(device, compute_dtype, t.skip_nonfinite_steps)
    # Reducing gradients after the last micro-batch only: FSDP accumulates unsharded gradients until then. (A
    # pipeline schedule does so within a local batch itself.)
    defer_reduce = dims.fsdp and dims.pp == 1 and cfg.parallelism.fsdp_defer_grad_reduce
    fpt = flops_per_token(n_params, model_args.n_layers, model_args.n_heads, model_args.head_dim, t.seq_len,
                          n_embedding)
    peak = peak_flops(device, compute_dtype if (dims.fsdp or autocast) else torch.float32)

    def train_context():
        stack = contextlib.ExitStack()
        if use_loss_parallel:
            stack.enter_context(loss_parallel())
        if autocast:
            stack.enter_context(torch.autocast(device.type, dtype=compute_dtype))
        return stack

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor, tokens: int) -> torch.Tensor:
        """Sum of the token losses / `tokens` (a DTensor under loss parallel)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / tokens

    def value(loss: torch.Tensor) -> torch.Tensor:
        return (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()

    def forward_backward(inputs: torch.Tensor, labels: torch.Tensor, tokens: int, train: bool = True) -> torch.Tensor:
        """A local batch's loss (detached), and with `train` its gradients added to the parameters' .grad; call in
        train_context. Under PP the pipeline schedule is this same call (pipeline.Pipeline)."""
        loss = loss_fn(model(to_device(inputs, device)), to_device(labels, device), tokens)
        if train:
            guard.scale(loss).backward()  # inside the context: loss parallel's backward needs it too
        return value(loss)

    if dims.pp > 1:
        forward_backward = Pipeline(parts, mesh["pp"], device, cfg, loss_fn, value, guard.scale)

    @torch.no_grad()
    def validate() -> float:
        """Loss on the same held-out batches every time: `validation.steps` global batches from the start."""
        loader = DataLoader(val_source, global_batch, t.local_batch_size, dp_mesh.get_local_rank(), dims.dp,
                            seq_share, pin)
        total = torch.zeros((), device=device)
        for _ in range(v.steps):
            for inputs, labels in loader.next_batch():
                with train_context():
                    total += forward_backward(inputs, labels, global_tokens * v.steps, train=False)
        dist.all_reduce(total, group=loss_mesh.get_group())
        return total.item()

    # ---- Checkpoint: resume from the newest complete checkpoint in the folder, or start from
    # checkpoint.initial_load_path.
    train_state = TrainState()
    # Closed on every way out: an in-flight async save is published or, failed, cleared; old ones finish deleting.
    checkpoint = exits.enter_context(CheckpointManager(cfg.checkpoint, cfg.job.dump_folder, model, optimizer,
                                                       scheduler, data, train_state, guard, t.steps))
    resumed = 0 if cfg.checkpoint.create_seed_checkpoint else checkpoint.load()
    if train_state.step >= t.steps:
        logger.info("the checkpoint is at step %d, training.steps is %d: nothing to do", train_state.step, t.steps)
        return
    # The folder's metrics.jsonl, config.toml and tb/ become this run's, decided once the step it starts from is
    # known and before anything is written: a resume continues them, a fresh start moves an earlier run's aside.
    if env.rank == 0:
        start_history(cfg.job.dump_folder, resumed, to_toml(cfg), cfg.metrics.save_tb_folder, env.world_size)
    if cfg.checkpoint.create_seed_checkpoint:
        checkpoint.save(0, model_only=True)
        checkpoint.close()  # an async save is written only now
        logger.info("seed checkpoint written: runs on any mesh with this checkpoint folder start from it")
        return

    metrics = MetricLogger(cfg.job.dump_folder, env.rank, cfg.metrics.log_freq, cfg.metrics.enable_tensorboard,
                           cfg.metrics.save_tb_folder, start_step=train_state.step, config=to_toml(cfg))
    if cfg.training.gc_freq > 0:
        gc.disable()  # collect on a schedule instead, so all ranks pause at the same step
    step, start = train_state.step, time.perf_counter()
    # Agreeing on a signal takes a collective: on the CPU, so it overlaps GPU work (gloo is the CPU's default group).
    preemption = Preemption(dist.new_group(backend="gloo") if device.type == "cuda" else None)
    first_step, held = step + 1, {}  # the bytes held for state, measured at the first step, go in the next record
    last_log_time, last_log_step, stopped = start, step, None

    # ---- The loop.
    while step < t.steps:
        step += 1
        if t.gc_freq > 0 and step % t.gc_freq == 0:
            gc.collect(1)
        preemption.begin_step()
        loss_sum = torch.zeros((), device=device)
        batches = data.next_batch()
        for i, (inputs, labels) in enumerate(batches):
            if defer_reduce:
                model.set_requires_gradient_sync(i == len(batches) - 1)
            with train_context():
                loss_sum += forward_backward(inputs, labels, global_tokens)
        guard.unscale_(optimizer)  # fp16: clipping and the logged norm see the true gradients
        grad_norm = clip_grad_norm_(params, t.max_norm, env.world_size)
        lr = scheduler.get_last_lr()[0]
        guard.step(optimizer, grad_norm, step)  # skipped when a gradient is inf/NaN, decided on the device
        if step == first_step:
            held = held_bytes(model, optimizer)
            set_timeout(cfg.comm.train_timeout_seconds)  # start-up is over: a peer silent this long is hung
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_state.step, train_state.tokens_seen = step, train_state.tokens_seen + global_tokens

        val_loss = None
        if v.enable and (step % v.freq == 0 or step == t.steps):
            val_start = time.perf_counter()
            val_loss = validate()
            last_log_time += time.perf_counter() - val_start  # tokens/s and MFU measure training alone
        if metrics.should_log(step, last=step == t.steps) or val_loss is not None:
            guard.check()  # a step since the last log that must stop the run raises here (saves check too)
            dist.all_reduce(loss_sum, group=loss_mesh.get_group())
            now = time.perf_counter()
            tps = global_tokens * (step - last_log_step) / env.world_size / (now - last_log_time)
            metrics.log(step, {
                "loss": loss_sum.item(), "grad_norm": grad_norm.item(), "lr": lr, "tps": tps,
                "mfu": 100 * tps * fpt / peak, "memory_gib": memory_gib(device),
                "elapsed_s": train_state.elapsed_s(), "tokens_seen": train_state.tokens_seen,
                "world_size": env.world_size,  # changes when an elastic job shrinks or grows
                **guard.metrics(), **held,
                **({} if val_loss is None else {"val_loss": val_loss}),
            })
            last_log_time, last_log_step, held = now, step, {}
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        checkpoint.maybe_save(step, last=step == t.steps)
        if (received := preemption.requested()) and step < t.steps:
            if cfg.checkpoint.enable and step % cfg.checkpoint.interval:
                checkpoint.save(step)  # the full state, whatever the last save would be: the run goes on elsewhere
            logger.warning("%s: stopped after step %d%s", received, step, ", checkpoint saved: rerun the same command "
                           "to resume" if cfg.checkpoint.enable else " (checkpoint.enable is off: nothing saved)")
            stopped = received
            break
    guard.check()  # a preempted run may stop between logging steps
    checkpoint.close()  # waits for an async save still being written
    metrics.close()
    logger.info("training done: %d steps in %.1fs", step, time.perf_counter() - start)
    return stopped


def run(argv: list[str] | None = None, check: bool = False) -> int:
    """Trains; with `check`, only validates the config for WORLD_SIZE processes (exit 2 and one line if it is bad)."""
    env, stopped = Env.from_environ(), None
    stop_with_launcher()
    # A check says nothing unless something is wrong: the job it precedes logs what it reads.
    logging.basicConfig(level=logging.WARNING if check else logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    try:
        cfg = load_config(argv)
        if check:
            preflight(cfg, env.world_size)
        else:
            with contextlib.ExitStack() as exits:
                stopped = main(cfg, env, exits)
    except ConfigError as e:
        report(e, env)  # one line for the whole job, printed before any rank exits
        return 2
    except (NonFiniteError, CheckpointSaveError) as e:  # raised on every rank at the same step
        report(e, env)
        return 1
    except RuntimeError as e:
        if (timeout := peer_timeout(e)) is None:
            raise
        report(timeout, env)
        return 1
    finally:
        gc.enable()  # main() may have turned automatic collection off; a caller in this process gets it back
        restore_signals()
        if dist.is_initialized():
            dist.destroy_process_group()
    return exit_code(stopped)


if __name__ == "__main__":
    faulthandler.enable()  # a crash in native code (gloo, a kernel) still names the Python line it came from
    # run_train.sh starts torchrun, hence us, with Ctrl-C ignored (it forwards it itself): before the loop handles it,
    # Ctrl-C stops the start-up as usual.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    check = sys.argv[1:2] == ["--check"]
    code = run(sys.argv[2:] if check else None, check=check)
    gc.freeze()  # no final garbage collection over torch's objects at exit: about a second less per rank
    sys.exit(code)
