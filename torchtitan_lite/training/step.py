"""The step, written once: forward, loss and backward over a local batch's micro-batches, which the training loop,
validation, the memory estimator (memory.py) and the benchmarks all call.

The loss of a micro-batch is the sum of its token losses over the global token count of the step (every rank's
micro-batches together), and gradients are summed across ranks (parallelize.py): gradient accumulation and data
parallelism then give exactly the one big batch's gradient, and the step's loss is the sum of what its calls return.

How the step computes is decided once, from the config (`Numerics`): under tensor parallelism the logits stay sharded
on the vocabulary and the cross-entropy runs on the shards (loss parallel); FSDP applies mixed precision itself, so
autocast runs only without it (one process, TP alone).

A pipeline schedule is a second implementation of the same call (`PipelineStep`, chosen once at start-up by
`build_step`): the loop never asks which one it runs.

What the model gets beside a micro-batch's tokens is decided once too (`Inputs`): nothing (causal), or under
block_causal the document ids of each window (models/documents.py), computed from the whole windows before context
parallelism cuts them, since a rank's queries must know the documents of every gathered key; with multi-token
prediction, the tokens and targets of its depths (mtp.py), shifted on whole windows too.

Beside the loss, the step trains terms that ride on the logits and are logged apart (`side`): the z-loss (z_loss.py)
and multi-token prediction's loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan_lite.config import JobConfig
from torchtitan_lite.data.loader import to_device
from torchtitan_lite.models.documents import document_ids
from torchtitan_lite.models.common.moe import MoE
from torchtitan_lite.parallel.cp_blocks import token_blocks
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.pipeline import Pipeline
from torchtitan_lite.parallel.tp_blocks import blocked_cross_entropy
from torchtitan_lite.runtime import flight_recorder
from torchtitan_lite.runtime.precision import DTYPES
from torchtitan_lite.training.layout_invariant import Canonical, Summed
from torchtitan_lite.training.mtp import MTP
from torchtitan_lite.training.z_loss import ZLoss

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, labels) of one local batch


def token_loss(logits: torch.Tensor, labels: torch.Tensor, tokens: int, vocab_blocks: bool = False,
               token_blocks: int = 1) -> torch.Tensor:
    """The sum of the token losses over `tokens`, the step's global token count (a DTensor under loss parallel); with
    `vocab_blocks`, loss parallel's sums on one rank (training.layout_invariant without TP: parallel/tp_blocks.py);
    with `token_blocks` 2, each of CP 2's stacked halves' loss, added as the cp ranks' are (parallel/cp_blocks.py)."""
    if token_blocks > 1:
        first, second = (token_loss(x, y, tokens, vocab_blocks)
                         for x, y in zip(logits.chunk(token_blocks), labels.chunk(token_blocks)))
        return first + second
    if vocab_blocks:
        return blocked_cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / tokens
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / tokens


@torch.no_grad()
def row_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed token losses, detached: what a mixture's per-source loss adds up (source_losses.py).
    Computed beside token_loss, never instead of it, so the step's loss and gradients keep their bits."""
    losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    return loss_value(losses).view(labels.shape).sum(1)


def loss_value(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain detached tensor, for summing and logging (loss parallel leaves a DTensor)."""
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()


@dataclass(frozen=True)
class Numerics:
    """How the step computes, decided once from the config."""
    compute_dtype: torch.dtype  # the dtype matmuls run in (training.mixed_precision_param)
    autocast: bool  # FSDP casts by its mixed-precision policy; without FSDP autocast does
    loss_parallel: bool  # cross-entropy on vocabulary-sharded logits under TP
    vocab_blocks: bool = False  # loss parallel's sums without TP (training.layout_invariant: TP 2's order)
    token_blocks: int = 1  # 2: CP 2's token halves without CP (training.layout_invariant_cp: cp_blocks.py)

    @classmethod
    def from_config(cls, cfg: JobConfig, dims: ParallelDims) -> Numerics:
        compute_dtype = DTYPES[cfg.training.mixed_precision_param]
        return cls(compute_dtype, autocast=not dims.fsdp and compute_dtype != torch.float32,
                   loss_parallel=dims.tp > 1 and not cfg.parallelism.disable_loss_parallel,
                   vocab_blocks=dims.tp == 1 and cfg.training.layout_invariant,
                   token_blocks=token_blocks(cfg, dims.cp))

    def context(self, device_type: str) -> contextlib.ExitStack:
        """What forward and backward run in: loss parallel's backward needs it as much as its forward."""
        stack = contextlib.ExitStack()
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        if self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=self.compute_dtype))
        return stack


@dataclass(frozen=True)
class Inputs:
    """What the model gets from a micro-batch (inputs, labels) on the device: (inputs, labels, model keywords).
    Causal: the loader's batch as it is. block_causal (`bos_id` set): each window's document ids too. With `mtp`,
    in training, the depths' tokens (`mtp_tokens`) and the labels with each depth's targets after them (mtp.MTP).
    With either, under context parallelism, the loader hands whole windows and `shard` cuts them here, after."""
    bos_id: int | None = None
    shard: Callable[[torch.Tensor], torch.Tensor] | None = None
    mtp: MTP | None = None

    @classmethod
    def build(cls, bos_id: int | None, seq_share: Callable | None,
              mtp: MTP | None = None) -> tuple[Inputs, Callable | None]:
        """(the step's Inputs, the loader's shard) for the document-start id `bos_id` (None: causal), context
        parallelism's `seq_share` (None without it) and multi-token prediction's objective (None without)."""
        if bos_id is None and mtp is None:
            return cls(), seq_share
        return cls(bos_id, seq_share, mtp), None

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        kwargs = {}
        if self.bos_id is not None:
            kwargs["documents"] = document_ids(inputs, self.bos_id)
        if self.mtp is not None and torch.is_grad_enabled():  # validation measures the main model's loss alone
            kwargs["mtp_tokens"], labels = self.mtp.targets(labels)
        if self.shard is not None:
            inputs, labels = self.shard(inputs), self.shard(labels)
            if "mtp_tokens" in kwargs:
                kwargs["mtp_tokens"] = self.shard(kwargs["mtp_tokens"])
        return inputs, labels, kwargs


class Step:
    """The step of one rank: `train_step` adds a local batch's gradients to the parameters' .grad, `eval_step` only
    measures; both return the summed loss of their micro-batches (detached). The optimizer's update is the loop's."""

    # The losses a local batch computes, each a micro-batch's (a pipeline's: its micro-batches').
    losses_per_batch = 1

    def __init__(self, model: nn.Module, device: torch.device, numerics: Numerics,
                 scale: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss, defer_reduce: bool = False,
                 inputs: Inputs = Inputs(), z_loss: ZLoss | None = None,
                 accumulation: Summed | Canonical | None = None):
        self.model, self.device, self.numerics, self.inputs = model, device, numerics, inputs
        # How the micro-batches' gradients and losses add up: autograd's running sum, or the layout-invariant tree.
        self.accumulation = accumulation or Summed()
        # What rides on the logits beside the loss: PaLM's z-loss (training.z_loss) and multi-token prediction's
        # (the inputs'); `side_sums`: their values at the last train_step on this rank, each summed like the loss
        # (logged apart: source_losses.py).
        self.z_loss, self.mtp = z_loss, inputs.mtp
        self.side_sums = [torch.zeros((), device=device) for _ in self.side]
        self.scale = scale  # fp16's loss scaling (precision.UpdateGuard.scale)
        # During a train_step given a list of rows: where each micro-batch's row_losses go.
        self.rows: list[torch.Tensor] | None = None
        # Reduce gradients after the last micro-batch only: FSDP accumulates unsharded gradients until then.
        self.defer_reduce = defer_reduce
        # A mixture of experts' layers, whose auxiliary loss backward trains through their router weights, given the
        # loss's scale as its gradient (models/moe.WithLoss).
        self.moe_layers = [m for m in model.modules() if isinstance(m, MoE)] if model is not None else []

    @property
    def side(self) -> list:
        """The terms trained beside the loss (ZLoss, MTP), in the order they are logged."""
        return [term for term in (self.z_loss, self.mtp) if term is not None]

    def train_step(self, batches: list[Batch], tokens: int, rows: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch; `tokens` is the step's global token count. With `rows`, each
        micro-batch's sequence losses are appended to it (row_losses: a mixture's per source, source_losses.py)."""
        self.rows = rows
        self.accumulation.start(self.device)
        # The auxiliary losses' gradient: what the model's loss gets, scaled like it (fp16).
        seed = self.scale(torch.ones((), device=self.device))
        for layer in self.moe_layers:
            layer.aux_seed = seed
        for term in self.side:
            term.seed, term.values = seed, []
        try:
            for i, (inputs, labels) in enumerate(batches):
                if self.defer_reduce:
                    self.model.set_requires_gradient_sync(i == len(batches) - 1)
                with self.numerics.context(self.device.type):
                    self.accumulation.add(self.forward_backward(inputs, labels, tokens))
        finally:
            self.rows = None
        loss_sum = self.accumulation.finish()
        # The last ones: a pipeline's shape inference computes one loss of its own first.
        self.side_sums = [torch.stack(values).sum() if (values := term.values[-len(batches) * self.losses_per_batch:])
                          else torch.zeros((), device=self.device) for term in self.side]
        return loss_sum

    @torch.no_grad()
    def eval_step(self, batches: Iterable[Batch], tokens: int) -> torch.Tensor:
        """The summed loss of `batches`, each token's loss over `tokens`; no gradients."""
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in batches:
            with self.numerics.context(self.device.type):
                loss_sum += self.forward(inputs, labels, tokens)
        return loss_sum

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor, tokens: int) -> torch.Tensor:
        """One local batch's loss, with its graph for backward."""
        flight_recorder.at("the forward")
        inputs, labels, kwargs = self.inputs(to_device(inputs, self.device), to_device(labels, self.device))
        return self.token_loss(self.model(inputs, **kwargs), labels, tokens)

    def token_loss(self, logits: torch.Tensor, labels: torch.Tensor, tokens: int) -> torch.Tensor:
        if labels.dim() == 3:  # multi-token prediction's targets after the labels (Inputs): its depths' logits too
            logits, labels = self.mtp(logits, labels, tokens)
        if self.rows is not None:
            self.rows.append(row_losses(logits, labels))
        if self.z_loss is not None and torch.is_grad_enabled():  # training's: validation measures the loss alone
            logits = self.z_loss(logits, tokens)
        return token_loss(logits, labels, tokens, self.numerics.vocab_blocks, self.numerics.token_blocks)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, tokens: int) -> torch.Tensor:
        loss = self.loss(inputs, labels, tokens)
        flight_recorder.at("the backward")
        self.scale(loss).backward()
        return loss_value(loss)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, tokens: int) -> torch.Tensor:
        return loss_value(self.loss(inputs, labels, tokens))


class PipelineStep(Step):
    """The same step with each local batch run by a pipeline schedule over this rank's stages (pipeline.Pipeline):
    its loss is this rank's share, the value on the ranks holding the last stage and 0 elsewhere."""

    def __init__(self, parts: list[nn.Module], pp_mesh: DeviceMesh, device: torch.device, numerics: Numerics,
                 scale: Callable[[torch.Tensor], torch.Tensor], cfg: JobConfig, inputs: Inputs = Inputs(),
                 z_loss: ZLoss | None = None, accumulation: Summed | Canonical | None = None):
        # A schedule reduces per local batch itself.
        super().__init__(None, device, numerics, scale, inputs=inputs, z_loss=z_loss, accumulation=accumulation)
        self.moe_layers = [m for part in parts for m in part.modules() if isinstance(m, MoE)]
        # The canonical order sums each micro-batch's loss in its tree: the pipeline hands them, not their sum.
        self.pipeline = Pipeline(parts, pp_mesh, device, cfg, self.token_loss, loss_value, scale,
                                 leaves=isinstance(accumulation, Canonical))
        self.losses_per_batch = self.pipeline.microbatches

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, tokens: int) -> torch.Tensor:
        return self.pipeline.forward_backward(*self._prepared(inputs, labels), tokens)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, tokens: int) -> torch.Tensor:
        return self.pipeline.forward(*self._prepared(inputs, labels), tokens).sum()  # leaves' too: validation's sum

    def _prepared(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        return self.inputs(to_device(inputs, self.device), to_device(labels, self.device))


def build_step(model: nn.Module, parts: list[nn.Module], mesh: DeviceMesh, dims: ParallelDims, cfg: JobConfig,
               device: torch.device, numerics: Numerics, scale: Callable[[torch.Tensor], torch.Tensor],
               inputs: Inputs = Inputs(), dp_group=None) -> Step:
    """The step this rank runs: the pipeline's under PP, else the plain forward and backward of `model`; under
    training.layout_invariant, its sums in the canonical order over `dp_group`'s ranks (layout_invariant.py)."""
    z_loss = ZLoss.from_config(cfg.training.z_loss)
    accumulation = Canonical(list(model.parameters()), dp_group) if cfg.training.layout_invariant else Summed()
    if dims.pp > 1:
        return PipelineStep(parts, mesh["pp"], device, numerics, scale, cfg, inputs, z_loss, accumulation)
    return Step(model, device, numerics, scale, defer_reduce=dims.fsdp and cfg.parallelism.fsdp_defer_grad_reduce,
                inputs=inputs, z_loss=z_loss, accumulation=accumulation)
