"""Pipeline parallelism: the model cut into stages of whole blocks, run by a `torch.distributed.pipelining` schedule.

A stage is the full model with the blocks it does not own dropped (the modules before the blocks, Llama's embedding,
ride with the first stage; those after them, its final norm and output, with the last), so every parameter keeps its
full-model name: checkpoints, initialization and the Hugging Face export stay layout-free. Which modules come before and
after the blocks is the order the model registers them in (models/spec.py): any model's stages are cut alike. Stage s
lives on pipeline rank s % pp ("looped" placement): one stage per rank for GPipe and 1F1B, several for the interleaved
schedules.

Exactness: the loss of a micro-batch is its summed token losses over the global token count, so the schedule must
not rescale gradients (`scale_grads=False`): micro-batches, accumulation and data parallelism all add up to the one
big batch's gradient, as without PP.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from torchtitan_lite.config import ConfigError, JobConfig, Parallelism
from torchtitan_lite.data.loader import to_device
from torchtitan_lite.models.common.moe import MoE
from torchtitan_lite.runtime import flight_recorder
from torchtitan_lite.runtime.process import wait

# torch's schedule names -> whether the schedule runs several stages per rank. torch.distributed.pipelining itself
# is imported only by a pipelined run: it imports torch._dynamo, half a second more to every process's start.
SCHEDULES = {"GPipe": False, "1F1B": False, "Interleaved1F1B": True, "LoopedBFS": True}
# torch 2.13's other schedules, and why they are refused at start.
REFUSED = {
    "InterleavedZeroBubble": "it splits backward into input and weight passes, which FSDP's gradient reduction and "
                             "activation checkpointing here are not tested with",
    "ZBVZeroBubble": "it places stages in a V (rank r holds stages r and 2*pp-1-r), not looped",
    "DualPipeV": "it places stages in a V (rank r holds stages r and 2*pp-1-r), not looped",
    "PipelineScheduleSingle": "it is a base class, not a schedule",
    "PipelineScheduleMulti": "it is a base class, not a schedule",
}


def schedule_name(name: str) -> str:
    """torch's name of the schedule `name` (any case, as torch reads it), or one ConfigError line saying what to use
    instead."""
    supported = ", ".join(SCHEDULES)
    found = next((k for k in (*SCHEDULES, *REFUSED) if k.lower() == name.lower()), None)
    if found is None:
        raise ConfigError(f"unknown parallelism.pipeline_parallel_schedule {name!r}: choose one of {supported}")
    if found in REFUSED:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule {found} is not supported: {REFUSED[found]}; "
                          f"choose one of {supported}")
    return found


def stage_blocks(n_layers: int, n_stages: int) -> list[int] | None:
    """The blocks of each stage: n_layers / n_stages each; or, when only the blocks with the embedding and the output
    counted as one more each divide evenly, one fewer on the first and the last stage, which hold those
    (torchtitan's rule: Llama 3 405B's 126 blocks in 16 stages, 7, 8, ..., 8, 7). None when neither divides."""
    if n_layers % n_stages == 0:
        return [n_layers // n_stages] * n_stages
    per_stage = (n_layers + 2) // n_stages
    if n_stages > 1 and (n_layers + 2) % n_stages == 0 and per_stage > 1:
        return [per_stage - 1] + [per_stage] * (n_stages - 2) + [per_stage - 1]
    return None


def stages_per_rank(p: Parallelism, n_layers: int) -> int:
    """How many stages each pipeline rank holds, from the schedule and `pipeline_parallel_layers_per_stage`; raises
    one ConfigError line when the blocks cannot be cut that way."""
    pp, per_stage, name = p.pipeline_parallel_degree, p.pipeline_parallel_layers_per_stage, p.pipeline_parallel_schedule
    name = schedule_name(name)
    looped = SCHEDULES[name]
    if per_stage == -1:
        # Interleaved: the fewest stages per rank above one that split the blocks (2 if none does).
        v = next((v for v in range(2, n_layers // pp + 1) if stage_blocks(n_layers, pp * v)), 2) if looped else 1
        n_stages = pp * v
    elif n_layers % per_stage:
        raise ConfigError(f"parallelism.pipeline_parallel_layers_per_stage {per_stage} does not divide the model's "
                          f"{n_layers} blocks: choose a divisor of {n_layers}")
    else:
        n_stages = n_layers // per_stage
    if n_stages > n_layers:
        raise ConfigError(f"{n_stages} pipeline stages exceed the model's {n_layers} blocks: every stage needs at "
                          f"least one block; lower parallelism.pipeline_parallel_degree")
    if stage_blocks(n_layers, n_stages) is None:
        raise ConfigError(f"the model's {n_layers} blocks do not split evenly into {n_stages} pipeline stages: set "
                          f"parallelism.pipeline_parallel_layers_per_stage to a divisor of {n_layers}")
    if n_stages % pp:
        raise ConfigError(f"{n_stages} stages ({n_layers} blocks / {n_layers // n_stages} per stage) do not spread "
                          f"evenly over parallelism.pipeline_parallel_degree {pp}: make the stages a multiple of {pp}")
    v = n_stages // pp
    if looped and v < 2:
        raise ConfigError(f"{name} runs several stages per rank but {n_layers // n_stages} blocks per stage give one "
                          f"on each of {pp} ranks: halve parallelism.pipeline_parallel_layers_per_stage, or use 1F1B")
    if not looped and v > 1:
        raise ConfigError(f"{name} runs one stage per rank but {n_layers // n_stages} blocks per stage give {v}: set "
                          f"parallelism.pipeline_parallel_layers_per_stage = {n_layers // pp}, or use Interleaved1F1B")
    return v


def check_pipeline(p: Parallelism, n_layers: int, local_batch: int) -> tuple[int, int]:
    """(stages per rank, micro-batches per local batch), or one ConfigError line."""
    return stages_per_rank(p, n_layers), microbatches(p, local_batch)


def microbatches(p: Parallelism, local_batch: int) -> int:
    """The number of micro-batches a local batch is cut into, validated."""
    pp, m = p.pipeline_parallel_degree, p.pipeline_parallel_microbatches
    m = pp if m == -1 else m
    if m < pp:
        # torch's 1F1B refuses this and others hang (pytorch/torchtitan#775): some stage would idle the whole step.
        raise ConfigError(f"parallelism.pipeline_parallel_microbatches {m} is fewer than the {pp} pipeline stages: "
                          f"use at least {pp} (more shrink the pipeline bubble)")
    if local_batch % m:
        raise ConfigError(f"training.local_batch_size {local_batch} does not split into {m} pipeline micro-batches: "
                          f"make it a multiple of {m} or change parallelism.pipeline_parallel_microbatches")
    return m


def split_stages(model_class: Callable[..., nn.Module], model_args, pp_rank: int, p: Parallelism) -> list[nn.Module]:
    """This rank's stages of the model `model_class(model_args)` (its spec's), on the meta device: stages pp_rank,
    pp_rank + pp, ... of all, in order."""
    pp = p.pipeline_parallel_degree
    n_stages = pp * stages_per_rank(p, model_args.n_layers)
    blocks = stage_blocks(model_args.n_layers, n_stages)
    parts = []
    for stage in range(pp_rank, n_stages, pp):
        with torch.device("meta"):
            part = model_class(model_args)
        names = [name for name, _ in part.named_children()]
        before, after = names[:names.index("layers")], names[names.index("layers") + 1:]
        ties = _ties(part, before, after)
        first = sum(blocks[:stage])
        part.layers = nn.ModuleDict({str(i): part.layers[str(i)] for i in range(first, first + blocks[stage])})
        # The last stage keeps a module before the blocks that holds a parameter tied to one after them (tied
        # embeddings), unused by its forward, so that the parameter keeps the name it has on the first stage and in
        # one process (named_parameters names a tied parameter by its first module): in checkpoints and the optimizer;
        # and the embedding table, which multi-token prediction's modules use.
        kept = {name for name in before if stage == n_stages - 1 and ties & _ids(getattr(part, name))}
        for name in (before if stage > 0 else []) + (after if stage < n_stages - 1 else []):
            if name not in kept:
                setattr(part, name, None)
        part.stage = stage
        # For parallel/stage_ties.py: whether the model ties parameters across the stages, and this stage's of them.
        part.ties, part.tied = bool(ties), [name for name, p in part.named_parameters() if id(p) in ties]
        parts.append(part)
    return parts


def _ids(module: nn.Module | None) -> set[int]:
    return {id(p) for p in module.parameters()} if module is not None else set()


def _ties(model: nn.Module, before: list[str], after: list[str]) -> set[int]:
    """The parameters (their ids) held both before and after the blocks, or used after them: those the first and the
    last stage share. Multi-token prediction's modules (after the blocks) embed tokens by the embedding table."""
    shared = (set().union(*(_ids(getattr(model, n)) for n in before)) &
              set().union(*(_ids(getattr(model, n)) for n in after)))
    return shared | (_ids(model.tok_embeddings) if getattr(model, "mtp", None) is not None else set())


def merge_stages(parts: list[nn.Module]) -> nn.Module:
    """One module holding this rank's parameters under their full-model names (for the optimizer, the checkpoint
    and the norm); it shares the stages' modules and is never run itself."""
    if len(parts) == 1:
        return parts[0]
    merged = type(parts[0]).__new__(type(parts[0]))
    nn.Module.__init__(merged)
    merged.args = parts[0].args
    for name in parts[0]._modules:  # in the model's order; a module is held by one stage of the rank, or none
        held = [module for part in parts if (module := getattr(part, name)) is not None]
        setattr(merged, name, nn.ModuleDict({k: b for part in parts for k, b in part.layers.items()})
                if name == "layers" else next(iter(held), None))
    return merged


def _uncounted(infer: Callable) -> Callable:
    """A stage's metadata inference, with a mixture of experts' counts off (models/moe.MoE.counting): it trains
    nothing, and torch clears the gradients it leaves, not the load a router counts."""
    def run(*args, **kwargs):
        MoE.counting = False
        try:
            return infer(*args, **kwargs)
        finally:
            MoE.counting = True
    return run


def _reduced_each(stage) -> Callable:
    """The stage's backward of a micro-batch, then FSDP's reduction of its gradients, which torch 2.13's schedules
    leave to the end of the local batch (perform_reduce_grad) and so sum the micro-batches unsharded, in turn. A
    stage without FSDP reduces nothing: its parameters' .grad takes each micro-batch's as it comes."""
    backward = stage.backward_maybe_with_nosync

    def run(backward_type, bwd_kwargs, last_backward=False):
        result = backward(backward_type, bwd_kwargs, last_backward)
        if isinstance(stage.submod, FSDPModule) and backward_type != "input":  # a weight's gradient is there
            stage.perform_reduce_grad(1)
        return result
    return run


def _wait(works: list) -> None:
    flight_recorder.at(flight_recorder.P2P)  # gloo's flight recorder does not record point-to-point ops
    wait(works)


class Pipeline:
    """The pipelined forward and backward of one local batch: step.PipelineStep's implementation of the step.

    `loss_fn(logits, labels, tokens)` gives a micro-batch's loss; each call returns this rank's share of the summed
    loss (its value on the ranks holding the last stage, 0 elsewhere), detached; with `leaves`, the micro-batches'
    losses in order, unsummed (training.layout_invariant sums them in its tree)."""

    def __init__(self, parts: list[nn.Module], pp_mesh: DeviceMesh, device: torch.device, cfg: JobConfig,
                 loss_fn: Callable, loss_value: Callable, scale: Callable, leaves: bool = False):
        from torch.distributed.pipelining import PipelineStage, schedules

        p = cfg.parallelism
        n_stages = p.pipeline_parallel_degree * len(parts)
        group = pp_mesh.get_group()
        self.stages = [PipelineStage(part, part.stage, n_stages, device, group=group) for part in parts]
        for stage in self.stages:  # torch 2.13 infers shapes by a real forward and backward before the first step
            stage._prepare_forward_infra = _uncounted(stage._prepare_forward_infra)
        self.is_last = any(s.is_last for s in self.stages)
        self.loss_fn, self.loss_value, self.scale = loss_fn, loss_value, scale
        self.device, self.tokens, self.losses, self.leaves = device, 1, [], leaves
        # torch 2.13's schedules wait on their sends and receives with no timeout: ours (distributed.wait).
        schedules._wait_batch_p2p = _wait
        name = schedule_name(p.pipeline_parallel_schedule)
        cls = schedules.get_schedule_class(name)
        stages = self.stages if SCHEDULES[name] else self.stages[0]
        self.microbatches = microbatches(p, cfg.training.local_batch_size)
        self.schedule = cls(stages, self.microbatches, loss_fn=self._loss, scale_grads=False)
        if leaves:  # each micro-batch's gradients reduced on its own, a leaf of the canonical tree
            for stage in self.stages:
                stage.backward_maybe_with_nosync = _reduced_each(stage)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits, labels, self.tokens)
        self.losses.append(self.loss_value(loss))
        return self.scale(loss)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict, tokens: int) -> torch.Tensor:
        """The schedule's forward and backward: gradients added to the stages' parameters. `kwargs` (the documents
        of block_causal) are cut into micro-batches like the inputs and reach every stage, whose forward takes them
        beside the hidden states it receives."""
        return self._run(self.schedule.step, inputs, labels, kwargs, tokens)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict, tokens: int) -> torch.Tensor:
        """The schedule's forwards alone (validation)."""
        return self._run(self.schedule.eval, inputs, labels, kwargs, tokens)

    def _run(self, schedule_call: Callable, inputs: torch.Tensor, labels: torch.Tensor, kwargs: dict,
             tokens: int) -> torch.Tensor:
        self.tokens, self.losses = tokens, []
        schedule_call(to_device(inputs, self.device), target=to_device(labels, self.device), return_outputs=False,
                      **kwargs)
        if not self.is_last:
            return torch.zeros(self.microbatches if self.leaves else (), device=self.device)
        # The last m: at the first step, the stage's shape inference computes one loss of its own before them.
        losses = torch.stack(self.losses[-self.microbatches:])
        return losses if self.leaves else losses.sum()
