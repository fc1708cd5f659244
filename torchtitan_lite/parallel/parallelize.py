"""Parallelism applied from outside the model, in one order: TP, CP, EP, activation checkpointing, compile, FSDP.

What is the model's own comes from its spec (models/spec.py): which module TP splits which way (its plan). What is
done to every model is here: the blocks (`blocks(model)`: its layers, then multi-token prediction's modules) are
what checkpointing, compile and FSDP wrap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan_lite.config import JobConfig, Parallelism, Training
from torchtitan_lite.models.common.moe import MoE, swiglu_experts
from torchtitan_lite.models.spec import TPStyles, blocks
from torchtitan_lite.parallel import selective_ac
from torchtitan_lite.parallel.compile import apply_compile, compiled_experts
from torchtitan_lite.parallel.context_parallel import apply_cp
from torchtitan_lite.parallel.cp_blocks import apply_cp_blocks, token_blocks
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.expert_parallel import apply_ep
from torchtitan_lite.parallel.ordered_reduce import OrderedReduceScatter
from torchtitan_lite.parallel.sequence_slots import EarlierSlots
from torchtitan_lite.parallel.tp_blocks import apply_blocks
from torchtitan_lite.quantization import float8
from torchtitan_lite.runtime.precision import DTYPES

logger = logging.getLogger("torchtitan_lite")


def parallelize(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims, cfg: JobConfig, tp_plan: Callable) -> None:
    """`tp_plan`: the model spec's (ModelSpec.tp_plan)."""
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], tp_plan, loss_parallel=not cfg.parallelism.disable_loss_parallel)
    elif cfg.training.layout_invariant:  # TP 2's order of sums on this one tp rank (and CP 2's on one cp rank)
        apply_blocks(model, tp_plan, token_blocks(cfg, dims.cp))
    if dims.cp > 1:
        apply_cp(model, mesh["cp"], cfg.training.seq_len, cfg.parallelism.context_parallel_load_balancer,
                 whole_rows=cfg.training.layout_invariant)
    elif token_blocks(cfg, dims.cp) > 1:
        apply_cp_blocks(model, cfg.training.seq_len)
    moe = [module for module in model.modules() if isinstance(module, MoE)]
    if moe and dims.cp * dims.tp > 1:  # each rank routes part of every sequence: its auxiliary loss sums over them,
        group = dims.sequence_mesh(mesh).get_group()  # and its capacity counts the other parts' slots
        total = partial(dist.all_reduce, group=group)
        balancer = cfg.parallelism.context_parallel_load_balancer
        earlier = EarlierSlots.of_mesh(mesh, group, cfg.training.seq_len, balancer)
        for module in moe:
            module.sum_over_sequence, module.earlier_slots = total, earlier
    # What FSDP shards on a mesh of its own, before the blocks: expert parallelism's experts, and under TP a mixture of
    # experts, whose tp ranks route different tokens (sequence parallel): sharded over them as over data-parallel
    # ranks, which sums its gradients over them too.
    own = []
    if dims.ep > 1:
        experts_mesh = dims.experts_mesh(mesh)
        fsdp_dims = ("dp_replicate", "efsdp") if dims.dp_replicate > 1 else ("efsdp",)
        compute = compiled_experts(cfg.compile.backend) if cfg.compile.enable else swiglu_experts
        own.append((apply_ep(model, experts_mesh["ep"], compute, per_source=cfg.training.layout_invariant),
                    experts_mesh[fsdp_dims]))
    if moe and dims.tp > 1:
        own.append((moe, dims.moe_mesh(mesh)))
    if cfg.activation_checkpoint.mode != "none":
        apply_ac(model, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option,
                 keep_attention=cfg.compile.enable and dims.tp > 1)
    if cfg.compile.enable:  # in pieces around the dispatch of expert parallelism (compile.py)
        apply_compile(model, cfg.compile.backend, around_dispatch=dims.ep > 1)
    if dims.fsdp or own:
        apply_fsdp(model, dims.fsdp_mesh(mesh) if dims.fsdp else None, cfg, own)
    if cfg.activation_checkpoint.mode == "selective" and cfg.activation_checkpoint.selective_ac_option == "op":
        selective_ac.uncount_inner_units(blocks(model))  # after FSDP: around its hooks


def warn_ignored_options(cfg: JobConfig, dims: ParallelDims) -> None:
    """One warning line for options set away from their defaults that this layout never reads, so a degree left at
    1 by mistake does not pass for a run with FSDP, a pipeline or context parallelism. Called once per run, not from
    parallelize(), which runs once per pipeline stage."""
    p, default = cfg.parallelism, Parallelism()
    reasons = []
    for prefix, ignored, why in (
            ("fsdp_", not dims.fsdp, "no data parallelism in this layout, so FSDP is not applied"),
            ("pipeline_parallel_", dims.pp == 1, "no pipeline in this layout (pipeline_parallel_degree = 1)"),
            ("context_parallel_", dims.cp == 1, "no context parallelism in this layout (context_parallel_degree = 1)")):
        # A degree is never among them: with its dimension absent it is at its default, 1.
        keys = [f"parallelism.{k}" for k in vars(p) if k.startswith(prefix) and getattr(p, k) != getattr(default, k)]
        if ignored and keys:
            reasons.append(f"{why}: {', '.join(keys)} ignored")
    # Only FSDP's MixedPrecisionPolicy reads these; without it autocast computes in the param dtype (precision.py).
    fsdp_only = [f"training.{k}" for k in ("mixed_precision_reduce", "mixed_precision_output",
                                           "mixed_precision_cast_forward_inputs")
                 if getattr(cfg.training, k) != getattr(Training(), k)]
    if not dims.fsdp and fsdp_only:
        reasons.append(f"no FSDP in this layout, so no mixed-precision policy: {', '.join(fsdp_only)} ignored")
    if dims.pp > 1 and dims.fsdp and p.fsdp_defer_grad_reduce:
        reasons.append("a pipeline schedule reduces gradients once per local batch itself: "
                       "parallelism.fsdp_defer_grad_reduce ignored")
    reasons += float8.ignored_options(cfg, dims.fsdp)
    if reasons:
        logger.warning("%s", "; ".join(reasons))


BLOCKS = "layers.*."  # a TP plan's prefix of the entries that hold for every block
MTP_BLOCKS = "mtp.*."  # and of those that hold for multi-token prediction's modules besides (models/common/mtp.py)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: Callable, loss_parallel: bool) -> None:
    """The model's TP plan, in torch's styles: its own modules', those of the blocks, block by block, since a
    tensorwise float8 block takes torchao's styles, which cast to float8 before they gather (float8.py)."""
    styles = TPStyles(ColwiseParallel, RowwiseParallel, PrepareModuleInput, SequenceParallel, EmbeddingParallel,
                      Replicated)
    root = {k: v for k, v in tp_plan(styles, loss_parallel).items()
            if not k.startswith((BLOCKS, MTP_BLOCKS)) and _held(model, k)}
    parallelize_module(model, tp_mesh, root)
    mtp = set(map(id, model.mtp.values())) if getattr(model, "mtp", None) is not None else set()
    for block in blocks(model):
        colwise, rowwise, prepare = float8.tp_styles(block) or styles[:3]
        plan = tp_plan(styles._replace(colwise=colwise, rowwise=rowwise, prepare_input=prepare), loss_parallel)
        prefixes = (BLOCKS, MTP_BLOCKS) if id(block) in mtp else (BLOCKS,)
        plan = {k.split(".", 2)[2]: v for k, v in plan.items() if k.startswith(prefixes)}
        parallelize_module(block, tp_mesh, {k: v for k, v in plan.items() if _held(block, k)})
    if hasattr(model, "tie_weights"):  # each module holds a DTensor of its own now: tied ones become one again
        model.tie_weights()


def _held(module: nn.Module, name: str) -> bool:
    """Whether `module` holds the module `name`; False where it holds None, as a pipeline stage does for the pieces
    other stages hold. A name it lacks altogether is the plan's mistake, which parallelize_module would pass over in
    silence, leaving that module unsplit: AttributeError."""
    for part in name.split("."):
        if (module := getattr(module, part)) is None:
            return False
    return True


class Replicated(ParallelStyle):
    """A module every tp rank holds whole and runs on the same inputs (MLA's latents' projections and norms): its
    parameters Replicate DTensors and its inputs made Replicate DTensors, so that backward sums over the ranks what
    the heads' split leaves partial and the gradient norm counts its gradients once (optim.clip_grad_norm_). Its
    output stays a DTensor; with `use_local_output` it leaves as a tensor whose gradient each rank gives in part (a
    Partial placement), where it meets the heads' split."""

    def __init__(self, use_local_output: bool = False):
        super().__init__()
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def inputs(mod, args, mesh):
            return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                         if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

        def output(mod, out, mesh):
            if not self.use_local_output:
                return out
            # A replicated output's gradient each rank gives in part; a sequence shard's is the rank's own.
            return out.to_local(grad_placements=[Partial()] if out.placements[0].is_replicate() else None)

        return distribute_module(module, device_mesh, None, inputs, output)


class EmbeddingParallel(RowwiseParallel):
    """RowwiseParallel whose output reduce-scatter is waited for before the embedding returns.

    torch 2.13 bug (pytorch/pytorch#179849, fixed by #191113 after 2.13): a compiled block whose input is an
    AsyncCollectiveTensor (what RowwiseParallel's async redistribute leaves after `to_local`) unwraps it with
    `trigger_wait()`, which drops its autograd edge: the embedding gets no gradient (with FSDP) or backward crashes
    in redistribute (TP alone). The first block's norm needs the activations at once, so waiting here costs no
    overlap."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local() if use_local_output else outputs


# The attention kernels: the costliest ops to recompute, and the ones torch tags as random (they take a dropout
# probability), which matters to compiled activation checkpointing (apply_ac).
ATTENTION_OPS = (torch.ops.aten._scaled_dot_product_flash_attention.default,
                 torch.ops.aten._scaled_dot_product_efficient_attention.default,
                 torch.ops.aten._scaled_dot_product_cudnn_attention.default,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)


def apply_ac(model: nn.Module, mode: str, option: str, keep_attention: bool = False) -> None:
    """Full: recompute every block in backward. Selective N: every N-th block. Selective "op": keep matmul and
    attention outputs, recompute the cheap element-wise ops.

    Selective "op" keeps the collectives' outputs too (expert parallelism's all-to-alls, TP's reduce-scatters) and
    copies to the host: selective_ac.py.

    `keep_attention` (compiled blocks under TP): recomputed blocks keep their attention output too. torch 2.13 bug:
    recomputing a random-tagged op inside a compiled block stashes its RNG state among the saved values after the
    DeviceMesh that TP's DTensors save, an order AOTAutograd's runtime misreads ("expected all
    tensors_saved_with_vc_check to be Tensors"). Kept, the kernel is never recomputed; the cost is one more
    activation per block, the size of the block's input under sequence parallelism."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    keep = ATTENTION_OPS if keep_attention else ()
    if mode == "selective" and option == "op":
        keep = (torch.ops.aten.mm.default, *ATTENTION_OPS, *selective_ac.COLLECTIVES)
    policy = selective_ac.policy_keeping(keep)
    kwargs = {"context_fn": partial(selective_ac.contexts, policy)} if keep else {}
    every = int(option) if mode == "selective" and option != "op" else 1
    for held in (model.layers, getattr(model, "mtp", None) or {}):  # an MTP module's index is its depth's
        for name, block in list(held.items()):
            if int(name) % every == 0:  # the full model's block index: a pipeline stage holds some blocks
                held[name] = checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh | None, cfg: JobConfig,
               own: list[tuple[list[nn.Module], DeviceMesh]] = ()) -> None:
    """FSDP2 on each block, then the root. A 2-D mesh (replicate, shard) gives HSDP; shard size 1 gives DDP.
    `own`: modules FSDP shards on a mesh of their own (within their blocks), first, each group with its mesh; with
    `dp_mesh` None (no data parallelism) nothing else."""
    t, p = cfg.training, cfg.parallelism
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[t.mixed_precision_param],
                              reduce_dtype=DTYPES[t.mixed_precision_reduce],
                              cast_forward_inputs=t.mixed_precision_cast_forward_inputs)
    # Only the root's output is the model's output; a block's would be cast back by the next block's input cast.
    root_mp = MixedPrecisionPolicy(mp.param_dtype, mp.reduce_dtype, DTYPES.get(t.mixed_precision_output),
                                   mp.cast_forward_inputs)
    offload = CPUOffloadPolicy(pin_memory=p.fsdp_offload_pin_memory) if p.fsdp_cpu_offload else OffloadPolicy()
    held = blocks(model)
    # These reshard after forward unless "never": an hpZ group size N is the dense weights' (it divides dp_shard,
    # not necessarily the experts' efsdp).
    # Under expert parallelism (own units) routers stay eager between compiled pieces (compile.py).
    gate_mp = fp32_gate_policy(mp, compiled=cfg.compile.enable and not own)
    for modules, mesh in own:
        for module in modules:
            reshard = p.fsdp_reshard_after_forward != "never"
            fp32_gates(module, mesh, gate_mp, offload_policy=offload, reshard_after_forward=reshard)
            fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=offload,
                        shard_placement_fn=experts_dim(mesh), reshard_after_forward=reshard)
    if dp_mesh is not None:
        _shard_blocks(model, held, dp_mesh, p, mp, root_mp, offload, gate_mp)
    # The loss is already normalized by the global token count, so gradients must be summed across data-parallel
    # ranks, not averaged: one exact rule for every layout and accumulation. Plain SUM collectives, since gloo
    # has no PREMUL_SUM (and NCCL's SUM is its zero-copy path).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            if t.layout_invariant:  # the shards' sums in the canonical tree's order (training/layout_invariant.py)
                module.set_custom_reduce_scatter(OrderedReduceScatter())


def _shard_blocks(model: nn.Module, blocks: list[nn.Module], dp_mesh: DeviceMesh, p: Parallelism,
                  mp: MixedPrecisionPolicy, root_mp: MixedPrecisionPolicy, offload: OffloadPolicy,
                  gate_mp: MixedPrecisionPolicy | None = None) -> None:
    for i, block in enumerate(blocks):
        reshard = reshard_after_forward(p.fsdp_reshard_after_forward, i == len(blocks) - 1,
                                        p.pipeline_parallel_degree > 1)
        fp32_gates(block, dp_mesh, gate_mp, offload_policy=offload, reshard_after_forward=reshard)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, offload_policy=offload,
                    shard_placement_fn=experts_dim(dp_mesh), reshard_after_forward=reshard)
    # The root (embedding, final norm, output) is needed first in backward: kept gathered unless "always".
    fully_shard(model, mesh=dp_mesh, mp_policy=root_mp, offload_policy=offload,
                reshard_after_forward=p.fsdp_reshard_after_forward == "always")
    if p.fsdp_prefetch > 0:
        # Explicit prefetching issues the next N blocks' all-gathers at once, so they overlap more compute than
        # FSDP2's implicit one-ahead, at the cost of N blocks' unsharded parameters held at a time.
        for order, setter in ((blocks, "set_modules_to_forward_prefetch"),
                              (blocks[::-1], "set_modules_to_backward_prefetch")):
            for i, block in enumerate(order):
                getattr(block, setter)(order[i + 1:i + 1 + p.fsdp_prefetch])


def fp32_gate_policy(mp: MixedPrecisionPolicy, compiled: bool) -> MixedPrecisionPolicy | None:
    """The policy of the router gates' own FSDP units (fp32_gates): `mp` with fp32 parameters, where `mp` computes in
    a lower dtype; None where it does not (fp32 runs keep their units and collectives as they were) or where the blocks
    are compiled whole (`compiled`): a unit inside a block's one graph would call FSDP's hooks, which dynamo does not
    trace, and there moe.gate_logits upcasts the block's bf16 cast of the weight instead (torchtitan's way). Blocks
    compiled in pieces around EP's dispatch keep their routers eager, and these units (compile.py)."""
    if compiled or mp.param_dtype in (None, torch.float32):
        return None
    return MixedPrecisionPolicy(torch.float32, mp.reduce_dtype, None, mp.cast_forward_inputs)


def fp32_gates(module: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy | None, **kwargs) -> None:
    """Each mixture of experts' router gate within `module` made an FSDP unit of its own under `policy`, which gathers
    it in fp32: inside its block's unit it would get the bf16 cast, and the gate computes in fp32 from its master
    weight (moe.gate_logits). Its gradient reduces as the others' do."""
    if policy is None:
        return
    for m in module.modules():
        if isinstance(m, MoE) and not isinstance(m.router.gate, FSDPModule):  # already one under TP: its mixture's
            fully_shard(m.router.gate, mesh=mesh, mp_policy=policy, **kwargs)


def experts_dim(mesh: DeviceMesh) -> Callable[[nn.Parameter], Shard | None]:
    """FSDP's placement of a parameter on `mesh` (its last dim shards): the routed experts' 3-D weights on dim 0, the
    experts, where this rank's experts split evenly over the shard ranks, else on dim 1 (torchtitan does the same).
    FSDP pads dim 0 up to a multiple of the ranks: Mixtral's 8 experts, one per rank of EP 8, over 4 more ranks would
    leave each holding its whole expert, 4x the memory of a quarter. Any other parameter: FSDP's default, dim 0."""
    size = mesh.size(-1)

    def place(param: nn.Parameter) -> Shard | None:
        local = param.to_local() if isinstance(param, DTensor) else param  # under EP: this rank's experts
        return Shard(1) if param.dim() == 3 and local.shape[0] % size else None

    return place


def reshard_after_forward(policy: str, last_block: bool, pipelined: bool = False) -> bool | int:
    """A block's `reshard_after_forward` under `parallelism.fsdp_reshard_after_forward`. "default" reshards every
    block but the last, whose parameters backward needs first; an integer N (hpZ) keeps them sharded over groups of
    N ranks after forward, so backward all-gathers within a group (a node) instead of across the whole shard dim."""
    if policy in ("always", "never"):
        return policy == "always"
    if pipelined and policy == "default":  # a stage runs forward per micro-batch: resharding re-gathers each time
        return False
    return not last_block and (True if policy == "default" else int(policy))
