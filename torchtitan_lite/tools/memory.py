"""Per-rank memory a config would need (`estimate_memory`), without GPUs; what a rank really holds is
`metrics.held_bytes`, which the trainer records at its first step.

The estimate runs the trainer's own code on fake tensors instead of a formula: a fake process group of the target world
size (rank 0, which holds the largest shards), the real ParallelDims mesh, the model built on meta and parallelized by
the real `parallelize()`, materialized as FakeTensors, and two training steps (the trainer's `step.Step`: forward,
loss, backward; then AdamW step, zero_grad) traced by torch's FSDPMemTracker, which follows every storage's life,
FSDP2's all-gather and reduce-scatter buffers and the storage resizes that free gathered parameters. Fake tensors
allocate nothing and compute nothing, so the cost is Python time per op (docs/performance.md has the times), and every
layout rule (TP shards, FSDP padding, hpZ, which block stays gathered after forward, what activation checkpointing
saves) is the trainer's by construction: a formula would have to be kept in step with parallelize.py by hand. Two
steps: the optimizer state exists from the first on, so the second is the steady state. The tracker is
memory_tracker.py's. Nearly all the time goes to the blocks: a model whose blocks are alike is traced with a few of
them, at three block counts, and each figure extrapolated to the model's count where they lie exactly on a line,
else every block is traced (memory_extrapolate.py says when, and why that is exact).

What the figures mean (bytes of rank 0):
- parameters, gradients, optimizer state: `held_bytes` of the fake model after the optimizer step, exactly what the
  trainer logs at step 1 (tests/multiprocess/test_estimate_memory.py compares the two).
- activations: the tensors the forward and the loss leave alive for backward (saved tensors, logits, the loss).
- transient: at the peak, everything that is neither state nor activation: gathered parameters (the current block,
  the prefetched ones, those kept gathered or hpZ-sharded after forward, in the compute dtype), all-gather and
  reduce-scatter buffers, backward temporaries (the logits' gradient among them). The optimizer step's own
  temporaries are left out: under fake tensors an in-place kernel allocates its outputs anew (fused AdamW on a GPU
  allocates nothing).
- peak: the most bytes alive at once on the device during the second step. With `fsdp_cpu_offload`, parameters,
  gradients and optimizer state live on the host: they are reported as host bytes and left out of the device peak.
Not included: the caching allocator's rounding and fragmentation, NCCL's and cuBLAS's workspaces, the CUDA context
(together often 1-5 GiB on a GPU), and torch.compile's effect on activations: the model runs eager here, because fake
tensors cannot be compiled. The trace runs on the CPU, so attention is the CPU's SDPA kernel, whose saved tensors
(output and log-sum-exp) match flash attention's.

Under context parallelism rank 0 runs its share of each sequence (seq_len / cp tokens, seq_len / (cp x tp) between
blocks under TP) and every block gathers the whole sequence's keys and values, which its attention keeps for
backward. The GPU's flash kernel applies the chunks' causal masks itself and keeps none, so the trace attends
unmasked (the same tensors saved), where the CPU would materialize a mask.

Document masking (`model.attn_mask_type = "block_causal"`) runs the trainer's masked step: the window's document ids
and every token's rotary row. On a GPU without CP the mask is FlexAttention's block mask, whose kernel keeps the same
tensors for backward as flash attention: the trace attends causally and `mask_bytes`, the block mask's, is added to
the activations and the peak (its build makes no seq x seq temporary). Under CP the mask is explicit on every device
(models/documents.py): the trace builds and keeps it (one per micro-batch, shared by every block), and `mask_bytes`
is its size.

Under pipeline parallelism rank 0 holds the first stage(s), which keep the most micro-batches' activations alive:
the trace runs rank 0's stages on micro-batches in the schedule's order on that rank, as many forwards ahead of
their backwards as the schedule runs there (GPipe all m, 1F1B p, LoopedBFS all v*m, Interleaved1F1B its warmup), with
a gradient of the right shape standing in for the one the next stage would send. The pipeline's send and receive
buffers (one micro-batch's hidden states each) are left out.

Float8 (`float8.enable_float8_linear = true`) traces the model the trainer builds, its linears converted to torchao's
Float8Linear before parallelization, as an SM89+ GPU runs it: `torch._scaled_mm`, whose fake kernel allocates only its
output, even where the config asks for `float8.emulate` (the CPU's emulation upcasts each operand to fp32: memory no
GPU spends). Parameters, gradients and optimizer state are the high-precision ones (float8 changes only the matmuls),
plus one fp32 scale per converted weight with `precompute_float8_dynamic_scale_for_fsdp`. Activations are what
nn.Linear saves: torchao keeps the high-precision input for backward. Transient adds the float8 copies each matmul
casts (1 byte an element: input, weight, output gradient), and with `enable_fsdp_float8_all_gather` FSDP gathers and
holds the converted weights unsharded at 1 byte an element (plus their scale), the other parameters at their own
size (tests/test_memory.py counts the gathered bytes).

A mixture of experts (models/common/moe.py) is traced as its routing is balanced, which fake tensors cannot decide: each
expert gets an equal share of the slots, so under expert parallelism each rank sends and receives its own slot count
through the all-to-alls, the largest buffers the dispatch holds (an imbalanced step holds more on the busy experts'
ranks); or, asked (`routing="worst"`, the script's --routing worst), at its bound: every rank's tokens sent to the
traced rank's experts, dropless or as many as a capacity factor lets through (memory_routing.py). The state (the
experts' weights, split over ep and FSDP-sharded over the rest, and their optimizer state) does not depend on it.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtitan_lite.config import ConfigError, JobConfig
from torchtitan_lite.data.hf_tokenizer import run_tokenizer, run_vocab_size
from torchtitan_lite.data.tokenizer import build_tokenizer
from torchtitan_lite.models import documents, registry
from torchtitan_lite.models.spec import Args
from torchtitan_lite.parallel import context_parallel
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.parallelize import parallelize
from torchtitan_lite.parallel.pipeline import merge_stages, microbatches, schedule_name, split_stages
from torchtitan_lite.quantization import float8
from torchtitan_lite.runtime.metrics import held_bytes
from torchtitan_lite.runtime.precision import UpdateGuard
from torchtitan_lite.tools import memory_extrapolate as extrapolation
from torchtitan_lite.tools.memory_routing import routed
from torchtitan_lite.tools.memory_tracker import DevicePeak, FSDPTracker, Tracker
from torchtitan_lite.training.optim import clip_grad_norm_
from torchtitan_lite.training.optimizers import build_optimizer
from torchtitan_lite.training.preflight import check_layout
from torchtitan_lite.training.mtp import MTP
from torchtitan_lite.training.step import Inputs, Numerics, Step
from torchtitan_lite.training.z_loss import ZLoss

progress = logging.getLogger(__name__)  # what the estimate is doing, as it goes (estimate_memory.py shows it)


@dataclass
class Estimate:
    """Bytes of one rank (rank 0); `host_bytes` is what CPU offload keeps in host memory instead of the device."""
    flavor: str
    vocab_size: int
    vocab_note: str  # where the vocabulary comes from (model_args)
    mesh: dict[str, int]
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    transient_bytes: int
    peak_bytes: int
    host_bytes: int
    mask_bytes: int = 0  # block_causal: the document mask of one micro-batch (already in activations and peak)
    traced: tuple[int, ...] = ()  # the blocks traced: all of them, or the few counts the figures are extrapolated from
    routing: str = "balanced"  # a mixture's routing the figures hold: "balanced", or "worst" (memory_routing.py)


def model_args(cfg: JobConfig) -> tuple[Args, str]:
    """The trainer's model args for `cfg`, and where their vocabulary comes from: the config's tokenizer, or where its
    file is missing, the flavor's published vocabulary (its spec's published_vocab: the big configs point at their
    makers' tokenizers, which an estimate should not need)."""
    spec, path, flavor = registry.get(cfg.model.name), cfg.model.tokenizer_path, cfg.model.flavor
    if cfg.checkpoint.initial_load_in_hf and not path:  # the Hugging Face folder's, as the run's (train.py)
        folder = cfg.checkpoint.initial_load_path
        return spec.run_args(cfg, run_vocab_size(cfg, run_tokenizer(cfg))), f"vocabulary of {folder}"
    try:
        vocab = build_tokenizer(path).n_words
        note = f"vocabulary of {path}" if path else 'byte-level vocabulary: model.tokenizer_path = ""'
    except FileNotFoundError:
        if flavor in spec.flavors and flavor not in spec.published_vocab:  # an unknown one: run_args names the flavors
            raise ConfigError(f"model.tokenizer_path {path} not found, and flavor {flavor} has no published "
                              'vocabulary to assume: give a tokenizer file, or "" for bytes') from None
        vocab, note = spec.published_vocab.get(flavor, 0), f"{path} not found: {flavor}'s published vocabulary assumed"
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.tokenizer_path: {e}") from None
    return spec.run_args(cfg, vocab), note


def estimate_memory(cfg: JobConfig, world_size: int, extrapolate: bool | None = None,
                    routing: str = "balanced") -> Estimate:
    """Per-rank memory of training `cfg` on `world_size` ranks; see the module docstring for what each figure holds.
    Raises ConfigError for a config the trainer would reject. Needs no process group (it makes a fake one).
    `extrapolate`: whether a model of alike blocks may be traced with a few of them (memory_extrapolate.py); by
    default where the few together are fewer than the model's, True wherever its rule allows, False never.
    `routing`: a mixture of experts' routing the step is traced with (memory_routing.py): "balanced" or "worst"."""
    cfg = copy.deepcopy(cfg)
    cfg.compile.enable = False  # fake tensors cannot be compiled: the estimate is of the eager model
    if cfg.parallelism.fsdp_cpu_offload:
        cfg.parallelism.fsdp_offload_pin_memory = False  # pinned or not, the same bytes; pinning needs a GPU here
    args, vocab_note = model_args(cfg)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    cfg.float8.emulate = False  # float8: the GPU's matmuls, whose fake kernel allocates only the output (docstring)
    with mock.patch.object(float8, "has_float8_matmul", lambda: True):
        check_layout(cfg, dims, args)  # the trainer's preflight of the layout
    plan = extrapolation.plan(cfg, dims, args, registry.get(cfg.model.name)) if extrapolate is not False else None
    if plan and (extrapolate or sum(plan.counts) < args.n_layers):  # by default, only where it saves time
        progress.info("its %d blocks are alike: tracing %d, %d and %d of them, to extrapolate", args.n_layers,
                      *plan.counts)
        traces = [_trace(cfg, dims, replace(args, n_layers=n), vocab_note, of=args.n_layers, routing=routing)
                  for n in plan.counts]
        estimate, refusal = extrapolation.extrapolate(traces, plan, args.n_layers)
        if estimate is not None:
            progress.info("extrapolated to %d blocks: every figure is affine in the block count", args.n_layers)
            return estimate
        progress.info("%s: tracing all %d blocks", refusal, args.n_layers)
    return _trace(cfg, dims, args, vocab_note, routing=routing)[0]


def _trace(cfg: JobConfig, dims: ParallelDims, args: Args, vocab_note: str, of: int | None = None,
           routing: str = "balanced") -> tuple[Estimate, dict | None]:
    """The estimate of the model of `args`; when it holds a few of the model's `of` blocks, also the peak (bytes,
    transient bytes) of each segment of the measured step (memory_tracker.DevicePeak), as the estimate counts them."""
    # Imported here: the fake backend registers itself on import, and only the estimate needs it.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dims.world_size)
    try:
        mesh = dims.build_mesh("cpu")[0]
        layout = " x ".join(f"{n} {d}" for n, d in zip(mesh.mesh_dim_names, mesh.shape) if d > 1) or "1 rank"
        progress.info("rank 0 of %d (mesh %s): building and parallelizing its model on meta%s", dims.world_size,
                      layout, "" if of is None else f", with {args.n_layers} of its {of} blocks")
        spec = registry.get(cfg.model.name)
        with torch.device("meta"):  # rank 0's stages, under PP
            parts = [spec.model_class(args)] if dims.pp == 1 else split_stages(spec.model_class, args, 0,
                                                                               cfg.parallelism)
        unmasked = mock.patch.object(context_parallel, "lower_right_masks", lambda ranges, _: [None] * len(ranges))
        with unmasked:  # the GPU's masks, not the CPU's (module docstring)
            for part in parts:  # outside fake mode: FSDP on top of TP builds meshes, from real (small) tensors
                if float8.enabled(cfg):
                    float8.convert(part, cfg, dims.fsdp)
                parallelize(part, mesh, dims, cfg, spec.tp_plan)
        # Real tensors may still come in (mesh coordinates, DTensor's bookkeeping): fake mode lets them through.
        fake = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
        progress.info("materializing rank 0's shards as fake tensors")
        with fake:
            for part in parts:
                part.to_empty(device="cpu")
        model = merge_stages(parts)
        # Outside fake mode: build_optimizer may probe the CPU's fused AdamW with real tensors; it allocates nothing.
        optimizer = build_optimizer(model, cfg, "cpu", registry.get(cfg.model.name).param_group)
        offload = cfg.parallelism.fsdp_cpu_offload
        host = ("SHARDED_PARAM", "SHARDED_GRAD", "OPT") if offload else ()
        # FSDPMemTracker follows one forward per module per step: not a pipeline's micro-batches.
        tracker_class = FSDPTracker if isinstance(model, FSDPModule) and dims.pp == 1 else Tracker
        numerics = Numerics.from_config(cfg, dims)
        guard = UpdateGuard(torch.device("cpu"), numerics.compute_dtype)  # fp16's loss scale, a real scalar
        mask, added = _document_mask(cfg, dims, numerics.compute_dtype)
        for part in parts:
            part.document_mask = documents.explicit_mask if dims.cp > 1 else lambda ids, dtype: None
        moe_args = registry.get(cfg.model.name).moe(args)
        with fake, routed(routing, moe_args, cfg.training.seq_len), \
                tracker_class(model, optimizer, host, segments=of is not None) as tracker:
            activations, held = _two_steps(parts, optimizer, cfg, dims, args, numerics, guard, tracker)
    finally:
        dist.destroy_process_group()
    state = sum(held.values())
    transient = tracker.transient(tracker.device_peak, tracker.device_snap)
    segments = None if of is None else {k: (peak + added, t) for k, (peak, t) in tracker.segments.items()}
    return Estimate(cfg.model.flavor, args.vocab_size, vocab_note, dict(zip(mesh.mesh_dim_names, mesh.shape)),
                    **held, activation_bytes=activations + added, transient_bytes=transient,
                    peak_bytes=tracker.device_peak + added, host_bytes=state if offload else 0, mask_bytes=mask,
                    traced=(args.n_layers,), routing=routing), segments


def _document_mask(cfg: JobConfig, dims: ParallelDims, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of one micro-batch's document mask, bytes the trace leaves out and the estimate adds): FlexAttention's
    block mask on a GPU, which the trace cannot build; under CP the explicit mask, which it builds and counts."""
    if cfg.model.attn_mask_type == "causal":
        return 0, 0
    t = cfg.training
    batch = t.local_batch_size // (microbatches(cfg.parallelism, t.local_batch_size) if dims.pp > 1 else 1)
    if dims.cp > 1:
        return batch * t.seq_len**2 * dtype.itemsize, 0
    mask = documents.block_mask_bytes(batch, t.seq_len)
    return mask, mask


def _two_steps(parts: list[nn.Module], optimizer: torch.optim.Optimizer, cfg: JobConfig, dims: ParallelDims,
               args: Args, numerics: Numerics, guard: UpdateGuard,
               tracker: DevicePeak) -> tuple[int, dict[str, int]]:
    """train.py's step twice on fake data: (activation bytes, held bytes after step 1). Step 1 creates the optimizer
    state; step 2, the steady state, is the one measured. Without PP the trainer's own step (step.Step) on one
    micro-batch; under PP the first stage's schedule, stage by stage."""
    training = cfg.training
    model = merge_stages(parts)
    activations, held = 0, {}
    float8_scales = float8.ScalePrecompute(cfg, dims.fsdp, parts)  # as train.py: before step 1, after each step
    float8_scales()
    for step in (1, 2):
        progress.info("step %d of 2 (%s): forward", step, "creates the optimizer state" if step == 1 else "measured")
        tracker.reset_peaks()
        if dims.pp == 1:
            activations = _model_step(model, cfg, dims, args, numerics, guard, tracker)
        else:
            with numerics.context("cpu"):
                activations = _first_rank_stages(parts, cfg, dims, args, numerics.compute_dtype, tracker)
        clip_grad_norm_(list(model.parameters()), training.max_norm, dims.world_size)
        progress.info("step %d of 2: optimizer step", step)
        optimizer.step()
        float8_scales()
        if step == 1:
            held = held_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
    return activations, held


class _MeasuredStep(Step):
    """The trainer's step, noting the activation bytes once the forward and the loss are done, before backward."""

    def __init__(self, *args, tracker: DevicePeak, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker, self.after_forward = tracker, 0

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor, tokens: int) -> torch.Tensor:
        loss = super().loss(inputs, labels, tokens)
        self.after_forward = self.tracker.now()["ACT"]
        progress.info("backward")
        return loss


def _model_step(model: nn.Module, cfg: JobConfig, dims: ParallelDims, args: Args, numerics: Numerics,
                guard: UpdateGuard, tracker: DevicePeak) -> int:
    """One micro-batch of rank 0's tokens through the trainer's step; returns the activation bytes."""
    training = cfg.training
    inputs, seq_share = Inputs.build(_bos(cfg, args), _rank0_share(cfg, dims),
                                     MTP.from_config(args, training.mtp_weight))
    step = _MeasuredStep(model, torch.device("cpu"), numerics, guard.scale,
                         defer_reduce=dims.fsdp and cfg.parallelism.fsdp_defer_grad_reduce, tracker=tracker,
                         inputs=inputs, z_loss=ZLoss.from_config(training.z_loss))
    tokens = dims.global_batch(training.local_batch_size, training.global_batch_size) * training.seq_len
    before = tracker.now()["ACT"]
    # What the loader hands rank 0: its CP share of the windows, or whole windows that the masked step cuts.
    shape = (training.local_batch_size, training.seq_len // (1 if seq_share is None else dims.cp))
    batch = torch.randint(0, args.vocab_size, shape), torch.randint(0, args.vocab_size, shape)
    step.train_step([batch], tokens)
    return step.after_forward - before


def _bos(cfg: JobConfig, args: Args) -> int | None:
    """A document-start id for block_causal (any id: random tokens hold documents of ~vocab tokens), None if causal."""
    return None if cfg.model.attn_mask_type == "causal" else args.vocab_size - 1


def _rank0_share(cfg: JobConfig, dims: ParallelDims):
    """Rank 0's CP share of a sequence (context_parallel.sharder's, without a mesh), None without CP."""
    if dims.cp == 1:
        return None
    ranges = context_parallel.chunks(cfg.training.seq_len, dims.cp, 0, cfg.parallelism.context_parallel_load_balancer)
    return lambda x: context_parallel.shard(x, ranges)


def _first_rank_stages(parts: list[nn.Module], cfg: JobConfig, dims: ParallelDims, args: Args,
                       dtype: torch.dtype, tracker: DevicePeak) -> int:
    """Rank 0's stages in its schedule's order: as many forwards ahead of their backwards as the schedule runs there,
    each stage reducing after its last micro-batch; returns the activation bytes at the most forwards ahead."""
    training = cfg.training
    micro = microbatches(cfg.parallelism, training.local_batch_size)
    order = _first_rank_order(cfg.parallelism.pipeline_parallel_schedule, dims.pp, len(parts), micro)
    before = tracker.now()["ACT"]
    inputs, _ = Inputs.build(_bos(cfg, args), _rank0_share(cfg, dims))
    outputs = [_stage_forward(parts[stage], training.local_batch_size // micro, training.seq_len, args, dims, dtype,
                              inputs)
               for stage in order]
    activations = tracker.now()["ACT"] - before
    progress.info("backward, after %d micro-batch forwards of rank 0's stages", len(order))
    last = {stage: i for i, stage in enumerate(order)}
    for i, (stage, out) in enumerate(zip(order, outputs)):
        if isinstance(parts[stage], FSDPModule):
            parts[stage].set_requires_gradient_sync(i == last[stage])
        out.backward(torch.ones_like(out))  # the gradient the next stage would send
        outputs[i] = None
    return activations


def _first_rank_order(schedule: str, pp: int, v: int, m: int) -> list[int]:
    """Which of rank 0's v stages runs each forward its schedule makes before the first backward, m micro-batches a
    step (one forward without PP): the activations rank 0 holds at once."""
    if pp == 1:
        return [0]
    name = schedule_name(schedule)
    per_round = m // max(1, m // pp)
    if name == "Interleaved1F1B":  # torch's warmup on rank 0, then the first forward of its steady state
        ahead = min((v - 1) * per_round + 2 * (pp - 1) + 1, v * m)
    else:
        ahead = {"GPipe": m, "1F1B": pp, "LoopedBFS": v * m}[name]
    per_stage = m if name == "LoopedBFS" else per_round
    return [(i // per_stage) % v for i in range(ahead)]


def _stage_forward(part: nn.Module, batch: int, seq_len: int, args: Args, dims: ParallelDims,
                   dtype: torch.dtype, inputs: Inputs) -> torch.Tensor:
    """One micro-batch of rank 0's share of `seq_len`-token windows through one of its stages, which never holds the
    last (stage s runs on rank s % pp): its output hidden states. The first stage takes tokens; a later one, hidden
    states as the previous stage sends them, sequence-sharded under TP (and CP), and block_causal's document ids."""
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len if inputs.bos_id is not None else seq_len // dims.cp))
    tokens, _, kwargs = inputs(tokens, tokens)
    if part.stage > 0:
        tokens = torch.randn(batch, seq_len // dims.cp // dims.tp, args.dim, dtype=dtype, requires_grad=True)
    return part(tokens, **kwargs)
