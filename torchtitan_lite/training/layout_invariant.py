"""training.layout_invariant: every layout it covers gives the single process's bits (docs/layout_invariance.md).

The canonical order. A step's global batch is L micro-batches of training.local_batch_size sequences, the leaves.
Each leaf's loss and gradients come from a forward and backward of their own, with the same shapes on every layout,
so with the same bits. The step's gradient is the sum of the leaves in one tree, `tree_sum`: adjacent pairs first,
then pairs of those, an odd one carried up a level. A data-parallel degree D (a power of two) gives rank r leaf
m * D + r at micro-step m (the loader interleaves). The tree's lowest log2(D) levels then sum one micro-step's leaves
across the ranks: FSDP's reduce-scatter does it, in the tree's order (`OrderedReduceScatter`). The levels above sum
the micro-steps: each rank counts them in binary (`Accumulator`, at most log2(L) + 1 partial sums), which builds
the same tree. The logged loss is the same tree over the leaves' losses, and the grad norm is rounded to float32
(optim.clip_grad_norm_).

`check` refuses, in one line, what the mode does not cover yet.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from torchtitan_lite.config import ConfigError, JobConfig
from torchtitan_lite.models import registry
from torchtitan_lite.models.spec import ModelSpec
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.ordered_reduce import add, tree_sum
from torchtitan_lite.parallel.pipeline import microbatches

# What --check says the mode costs (docs/layout_invariance.md has the figures).
COST = ("training.layout_invariant: each micro-batch's gradients summed in one tree over ranks and micro-batches "
        "(an all-to-all in place of each reduce-scatter, up to log2(micro-batches) + 1 gradient copies, a gather "
        "of the step's losses)")

COST_CP = ("training.layout_invariant_cp 2: every module computes on CP 2's token halves apart (half-size matmuls, "
           "the halves' copies; under CP each rank's queries attend every key in one call)")


class Accumulator:
    """`tree_sum` of values pushed one at a time, holding at most log2(n) + 1 partial sums: a binary counter, whose
    carries merge two equal blocks and whose last blocks merge from the right. On D-leaf blocks (D a power of two)
    it builds the tree tree_sum builds over the leaves."""

    def __init__(self):
        self.blocks: list[tuple[int, object]] = []  # (leaves, their sum), sizes falling
        self.pushed = 0

    def push(self, value) -> None:
        self.pushed += 1
        size = 1
        while self.blocks and self.blocks[-1][0] == size:
            size, value = 2 * size, add(self.blocks.pop()[1], value)
        self.blocks.append((size, value))

    def total(self):
        value = None
        while self.blocks:
            value = add(self.blocks.pop()[1], value)
        return value


class Canonical:
    """The step's accumulation in the canonical order (Step's `accumulation`). Each parameter's gradient, as it
    arrives (reduced across data-parallel ranks by then: FSDP runs the hook after its reduce-scatter; a pipeline
    stage's after each micro-batch's backward), goes to the parameter's Accumulator and leaves .grad empty for the
    next; `finish` sets the tree's sum. The step's loss is the tree over every leaf's loss, gathered from the `group`'s
    ranks, on its rank 0 (0 elsewhere, so the logged loss's all-reduce adds only zeros to it)."""

    def __init__(self, params: list[torch.nn.Parameter], group: dist.ProcessGroup | None):
        self.params, self.group = params, group
        self.sums: dict[int, Accumulator] | None = None  # by id(param), from start() to finish()
        self.losses: list[torch.Tensor] = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._take)

    def _take(self, p: torch.Tensor) -> None:
        if self.sums is not None:
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                # TP's part of a norm weight's gradient: summed across the tp ranks now, each micro-batch's a leaf
                g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
            self.sums[id(p)].push(g)
            p.grad = None  # the next micro-batch's gradient arrives alone, not added to this one

    def start(self, device: torch.device) -> None:
        self.sums, self.losses = {id(p): Accumulator() for p in self.params}, []

    def add(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss, or a pipeline's local batch's: its micro-batches' losses, in order."""
        self.losses.append(loss)

    def finish(self) -> torch.Tensor:
        sums, self.sums = self.sums, None
        if len(counts := {acc.pushed for acc in sums.values()}) > 1:  # a leaf missing from one tree shifts its shape
            raise RuntimeError(f"training.layout_invariant: this step's parameters received {sorted(counts)} "
                               "gradients each; one a micro-batch left without a gradient is not covered")
        for p in self.params:
            p.grad = sums[id(p)].total()
        mine = torch.stack(self.losses).flatten()
        if self.group is None or dist.get_world_size(self.group) == 1:
            return tree_sum(list(mine))
        ranks = dist.get_world_size(self.group)
        every = mine.new_empty(ranks * len(mine))
        dist.all_gather_into_tensor(every, mine, group=self.group)
        total = tree_sum(list(every.view(ranks, -1).t().flatten()))  # leaf m * D + r: micro-step-major
        return total if dist.get_rank(self.group) == 0 else torch.zeros_like(total)


class Summed:
    """The default accumulation: autograd adds each micro-batch's gradients to .grad, the losses add in turn."""

    def start(self, device: torch.device) -> None:
        self.total = torch.zeros((), device=device)

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss

    def finish(self) -> torch.Tensor:
        return self.total


def leaf_size(cfg: JobConfig, dims: ParallelDims) -> int:
    """The leaf, in sequences: the micro-batch, or under PP the pipeline's micro-batch (0 with the mode off)."""
    if not cfg.training.layout_invariant:
        return 0
    local = cfg.training.local_batch_size
    return local // microbatches(cfg.parallelism, local) if dims.pp > 1 else local


def check(cfg: JobConfig, dims: ParallelDims, model_args) -> None:
    """What the mode covers so far: data parallelism (FSDP, HSDP and DDP over 2 replicas, power-of-two degrees),
    TP 2 (sequence and loss parallel) beside FSDP, pipeline parallelism (every schedule, untied weights), expert
    parallelism over 2 ranks, and CP 2 beside FSDP with every layout in its token halves (layout_invariant_cp 2,
    parallel/cp_blocks.py); in fp32, eager, by
    AdamW, for the models whose spec says bitwise_layouts, causal, on data that is not streamed, with any
    accumulation count and activation checkpointing. The rest sums in orders of its own, or is not yet shown
    bitwise: refused."""
    p, t = cfg.parallelism, cfg.training
    if not t.layout_invariant:
        if t.layout_invariant_cp > 1:
            raise ConfigError("training.layout_invariant_cp is training.layout_invariant's order: set "
                              "training.layout_invariant too, or layout_invariant_cp 1")
        return
    fix = "or drop training.layout_invariant (docs/layout_invariance.md says what it covers)"
    if dims.cp > 1 and dims.cp != t.layout_invariant_cp:
        raise ConfigError(f"training.layout_invariant's order is CP {t.layout_invariant_cp}'s "
                          f"(training.layout_invariant_cp), and parallelism.context_parallel_degree is {dims.cp}: set "
                          f"both 2 (every layout then computes in CP 2's token halves), or context_parallel_degree 1, "
                          f"{fix}")
    if t.layout_invariant_cp > 1:
        _check_cp_blocks(cfg, dims, model_args, fix)
    if dims.tp > 2:
        raise ConfigError(f"training.layout_invariant computes in TP 2's blocks, and parallelism.tensor_parallel_degree "
                          f"{dims.tp} sums more: use 2 or 1, {fix}")
    if dims.tp > 1 and (dims.pp > 1 or dims.dp_replicate > 1 or ModelSpec.moe(model_args) is not None
                        or cfg.training.z_loss > 0 or cfg.parallelism.disable_loss_parallel):
        raise ConfigError(f"training.layout_invariant shows TP 2 beside FSDP alone so far, on a dense model with loss "
                          f"parallel and no z-loss: set parallelism.tensor_parallel_degree 1, {fix}")
    if odd := [name for name, size in registry.get(cfg.model.name).tp_sizes(model_args).items() if size % 2]:
        raise ConfigError(f"training.layout_invariant computes in TP 2's blocks, and the model's {odd[0]} is odd: "
                          f"choose a flavor whose sizes TP 2 splits, {fix}")
    if dims.ep > 2:
        raise ConfigError(f"training.layout_invariant sums an expert's gradients over 2 expert-parallel sources so "
                          f"far (autograd adds more in an order of its own), and parallelism.expert_parallel_degree "
                          f"is {dims.ep}: use 2, {fix}")
    if dims.pp > 1 and (getattr(model_args, "tie_embeddings", False) or getattr(model_args, "mtp_depth", 0)):
        raise ConfigError(f"training.layout_invariant covers pipeline parallelism without tied weights so far (the "
                          f"stages' gradients of a tied table add in an order of their own), and model.flavor "
                          f"{cfg.model.flavor} ties its embedding table: set parallelism.pipeline_parallel_degree 1, "
                          f"{fix}")
    for name, degree in (("data_parallel_shard_degree", dims.dp_shard), ("data_parallel_replicate_degree",
                                                                         dims.dp_replicate)):
        if degree & (degree - 1):
            raise ConfigError(f"training.layout_invariant needs power-of-two data-parallel degrees (the ranks' sums "
                              f"are subtrees of one tree), and parallelism.{name} is {degree}: use a power of two, "
                              f"{fix}")
    if dims.dp_replicate > 2:
        raise ConfigError(f"training.layout_invariant sums replicas in one order over 2 of them so far (gloo's "
                          f"all-reduce of more orders its own), and parallelism.data_parallel_replicate_degree is "
                          f"{dims.dp_replicate}: use 2 replicas and a larger shard degree, {fix}")
    refused = [("training.mixed_precision_param", t.mixed_precision_param != "float32", "set it float32"),
               ("training.mixed_precision_reduce", t.mixed_precision_reduce != "float32", "set it float32"),
               ("compile.enable", cfg.compile.enable, "drop it"),
               ("float8", cfg.float8.enable_float8_linear or bool(cfg.float8.moe_fqns), "drop it"),
               ("parallelism.fsdp_defer_grad_reduce", p.fsdp_defer_grad_reduce, "drop it"),
               ("parallelism.fsdp_cpu_offload", p.fsdp_cpu_offload, "drop it"),
               ("fault_tolerance.enable", cfg.fault_tolerance.enable, "drop it"),
               ("optimizer.name", cfg.optimizer.name != "AdamW", "use AdamW"),
               (f"model.name {cfg.model.name}", not registry.get(cfg.model.name).bitwise_layouts,
                "use a model whose spec has bitwise_layouts"),
               ("moe.capacity_factor", bool(getattr(ModelSpec.moe(model_args), "capacity_factor", 0)), "set it 0"),
               ("model.attn_mask_type block_causal", cfg.model.attn_mask_type != "causal", "use causal"),
               ("a Hugging Face dataset", "hf" in _datasets(cfg), "pre-tokenize it (dataset 'tokens')")]
    for what, bad, change in refused:
        if bad:
            raise ConfigError(f"training.layout_invariant does not cover {what} yet (fp32, eager, AdamW, the "
                              f"models it has shown, causal, non-streaming data and one replica group are shown "
                              f"bitwise): {change}, {fix}")


def _check_cp_blocks(cfg: JobConfig, dims: ParallelDims, model_args, fix: str) -> None:
    """CP 2's token halves are shown on one process, data parallelism and CP 2 (beside FSDP), on a dense model."""
    fix = f"or set training.layout_invariant_cp 1, {fix}"
    if dims.tp > 1 or dims.pp > 1 or (dims.cp > 1 and dims.dp_replicate > 1):
        raise ConfigError(f"training.layout_invariant_cp 2 is shown beside data parallelism and CP 2 alone so far, "
                          f"not tensor, pipeline or (under CP) replicated data parallelism: set those degrees 1, {fix}")
    if cfg.training.seq_len % 4:
        raise ConfigError(f"training.layout_invariant_cp 2 cuts each sequence in CP 2's 4 chunks, and training.seq_len "
                          f"{cfg.training.seq_len} is not a multiple of 4: use a multiple of 4, {fix}")
    refused = [("a mixture of experts", ModelSpec.moe(model_args) is not None, "use a dense model"),
               ("training.z_loss", cfg.training.z_loss > 0, "set it 0"),
               ("parallelism.context_parallel_load_balancer none",
                cfg.parallelism.context_parallel_load_balancer != "headtail", "use headtail"),
               ("a mixture of datasets", cfg.training.dataset == "mixture", "train on one")]
    for what, bad, change in refused:
        if bad:
            raise ConfigError(f"training.layout_invariant_cp 2 does not cover {what} yet: {change}, {fix}")


def _datasets(cfg: JobConfig) -> set[str]:
    if cfg.training.dataset == "mixture":
        return {s.dataset for s in cfg.mixture.sources}
    return {cfg.training.dataset}
