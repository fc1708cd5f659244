"""A mixture-of-experts feed-forward: a router picks each token's top-k routed experts, which compute it, and their
outputs are summed with the router's weights, plus the shared experts' output that every token gets. Single-device
code, like the models that use it: expert parallelism and the other layouts are applied from outside.

Dropless by default: every token reaches each of its k experts, however uneven the routing; an optional capacity
factor bounds each expert's slots of a sequence (capacity.py). The routed experts are one 3-D weight per projection,
(experts, out, in), each expert's slice laid out as an nn.Linear weight: the token slots are sorted by expert,
computed group by group, and put back. Two implementations of that one call, chosen once per layer:
torch._grouped_mm (one kernel for every group) where the dtype and the strides allow it, and a loop over the experts
otherwise; on the same slots they give the same bits (tests/test_moe.py).

Routing is discontinuous: a top-k choice flips when two scores cross, whatever the rounding that made them cross.
The router therefore computes its scores in fp32, and the order of a token's k experts (the topk's, by score) fixes
the order in which their outputs are summed.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.config import ConfigError
from torchtitan_lite.models.common import capacity

@dataclass(frozen=True)
class MoEArgs:
    num_experts: int = 8
    top_k: int = 2
    hidden: int = 0  # each routed expert's hidden size; 0: the dense feed-forward's
    shared_experts: int = 0  # each of `hidden`; together one feed-forward of shared_experts x hidden
    score_func: str = "softmax"  # softmax over the experts (Mixtral, Qwen3) or each one's sigmoid (DeepSeek-V3)
    renormalize: bool = True  # the top-k weights divided by their sum (Mixtral, DeepSeek-V3)
    route_scale: float = 1.0  # the weights' factor after that (DeepSeek-V3: 2.5)
    every: int = 1  # every k-th block is MoE, the others dense (Llama 4 interleaves with 2)
    first_dense: int = 0  # the first n blocks dense (DeepSeek-V3: 3)
    load_balance_coeff: float = 0.0  # DeepSeek-V3's expert bias's step (1e-3); 0: no bias (training/expert_load.py)
    aux_loss_coeff: float = 0.0  # the Switch/Mixtral auxiliary loss's weight (Mixtral's config: 0.02); 0: none
    router_z_loss: float = 0.0  # ST-MoE's router z-loss weight (1e-3); 0: none
    capacity_factor: float = 0.0  # an expert's slots of a sequence at most this x its share (capacity.py); 0: dropless
    # DeepSeek-V3's group-limited routing (node-limited under EP), in Hugging Face's names: the experts in `n_group`
    # equal groups, a token's k chosen within its `topk_group` best groups, a group scored by its two best experts;
    # 1, 1: unlimited.
    n_group: int = 1
    topk_group: int = 1

    def is_moe(self, layer_id: int) -> bool:
        return layer_id >= self.first_dense and (layer_id + 1) % self.every == 0


def configured(flavor_args: MoEArgs | None, section, flavor: str) -> MoEArgs | None:
    """A flavor's MoEArgs (None: dense) with the config's [moe] settings (config.Moe) over them."""
    changes = {f.name: getattr(section, f.name) for f in fields(section) if getattr(section, f.name) not in (None, "")}
    if flavor_args is None and changes and "num_experts" not in changes:
        raise ConfigError(f"moe.{next(iter(changes))} is set but model.flavor {flavor} is dense: set moe.num_experts "
                          "too, to make its blocks mixtures of experts")
    args = replace(flavor_args or MoEArgs(), **changes) if changes else flavor_args
    if args is not None and args.top_k > args.num_experts:
        raise ConfigError(f"moe.top_k {args.top_k} exceeds the {args.num_experts} routed experts (moe.num_experts)")
    if args is not None and (args.num_experts % args.n_group or args.topk_group > args.n_group or
                             args.top_k > args.topk_group * args.num_experts // args.n_group):
        raise ConfigError(f"moe.n_group {args.n_group} must divide the {args.num_experts} routed experts, "
                          f"moe.topk_group {args.topk_group} be at most that, and their experts hold moe.top_k "
                          f"{args.top_k}: choose n_group and topk_group so")
    return args


class Router(nn.Module):
    """Each token's k experts and their weights, from a linear gate's scores."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        # The slots routed to each expert since the counts were last read (training/expert_load.py), and, with load
        # balancing, DeepSeek-V3's bias: added to the scores to choose the experts, not to weigh them.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        if args.load_balance_coeff > 0:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights, experts, scores, logits) of the tokens `x` (tokens, dim): (tokens, k) each, a token's experts by
        falling score; and every expert's score and gate logit (tokens, experts), in fp32."""
        a = self.args
        logits = gate_logits(self.gate, x)
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        if a.load_balance_coeff > 0 or a.n_group > 1:
            choice = scores + self.expert_bias if a.load_balance_coeff > 0 else scores
            experts = within_groups(choice, a.n_group, a.topk_group).topk(a.top_k, dim=-1).indices
            weights = scores.gather(-1, experts)
        else:
            weights, experts = scores.topk(a.top_k, dim=-1)
        if a.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * a.route_scale, experts, scores, logits


def within_groups(choice: torch.Tensor, groups: int, topk_groups: int) -> torch.Tensor:
    """The scores a token's experts are chosen by, (tokens, experts), with every expert outside the token's
    `topk_groups` best groups at -inf (DeepSeek-V3: a group's score is the sum of its two best); unchanged for 1
    group."""
    if groups == 1:
        return choice
    tokens, experts = choice.shape
    grouped = choice.view(tokens, groups, experts // groups)
    best = grouped.topk(min(2, experts // groups), dim=-1).values.sum(-1).topk(topk_groups, dim=-1).indices
    keep = torch.zeros(tokens, groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts)


def gate_logits(gate: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The gate's logits of the tokens `x`, (tokens, experts), computed in fp32 whatever the blocks compute in: a bf16
    matmul rounds scores into ties and swaps at the top-k boundary, and a flipped route moves the loss more than any
    rounding (docs/moe.md has the measured rates). So autocast is off for it, the tokens come in fp32, and the weight
    is the fp32 master: under FSDP's bf16 policy the gate is a unit of its own that gathers in fp32
    (parallel/parallelize.py). A weight held in a lower dtype (FSDP's cast in a compiled block, or a model cast whole)
    is upcast: its rounding stays, the matmul's is gone."""
    off = torch.autocast(x.device.type, enabled=False) if torch.is_autocast_enabled(x.device.type) else nullcontext()
    with off:
        if gate.weight.dtype == torch.float32:
            return gate(x.float())  # through the module: its own FSDP unit's hooks gather the weight
        return F.linear(x.float(), gate.weight.float())


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU feed-forwards, as 3-D weights (experts, out, in)."""

    # The grouped matmul (x, w, counts) -> grouped()'s result that a converter swapped in (MXFP8's:
    # quantization/mxfp8_experts.py); None: grouped() or looped(), whichever fits the operands.
    grouped_mm = None

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x`: token slots sorted by expert, counts[e] of them for expert e (every expert of these weights)."""
        return swiglu_experts(x, counts, self.w1, self.w2, self.w3, self.grouped_mm)

    def init_weights(self, init, out_std: float) -> None:
        init(self.w1, 0.02)
        init(self.w2, out_std)
        init(self.w3, out_std)


def swiglu_experts(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                   mm=None) -> torch.Tensor:
    """Each expert's SwiGLU of its slots: GroupedExperts' computation, on whichever experts' weights it is given
    (expert parallelism gives a rank's own), by its grouped matmul `mm` where it has one."""
    if torch.is_autocast_enabled(x.device.type):  # autocast knows nn.Linear's matmuls, not grouped_mm
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w1, w2, w3 = x.to(dtype), w1.to(dtype), w2.to(dtype), w3.to(dtype)
    mm = mm or (grouped if grouped_mm_fits(x, w1) else looped)
    return mm(F.silu(mm(x, w1, counts)) * mm(x, w3, counts), w2, counts)


def grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands well: bf16 where the device has its one-kernel path, or under
    compile (which cannot trace the loop's host read), or fp32 on the CPU outside compile (compile's fake kernel takes
    bf16 alone); strides that are multiples of 16 bytes. Elsewhere torch's fallback reads the offsets on the host, in
    fp32 or bf16: three syncs a call (nine a layer, forward and backward) to the loop's one (three a layer)."""
    compiling = torch.compiler.is_compiling()
    dtype_ok = ((x.dtype == torch.bfloat16 and (compiling or fast_grouped_mm(*device_kind(x.device))))
                or (x.dtype == torch.float32 and x.device.type == "cpu" and not compiling))
    elements = 16 // x.element_size()
    return dtype_ok and x.dtype == w.dtype and all(n % elements == 0 for n in w.shape[1:])


def device_kind(device: torch.device) -> tuple[str, tuple[int, int] | None]:
    """The device's type and, on an NVIDIA GPU, its compute capability (None elsewhere: ROCm's kernel choice depends
    on how torch was built, not on a capability)."""
    if device.type != "cuda" or torch.version.hip:
        return device.type, None
    props = torch.cuda.get_device_properties(device)
    return device.type, (props.major, props.minor)


def fast_grouped_mm(device_type: str, capability: tuple[int, int] | None) -> bool:
    """Whether torch._grouped_mm's bf16 kernel runs without host syncs there: the CPU's, and CUDA's on SM90 and SM100
    alone (torch 2.13's _grouped_mm_cuda: capability major 9 or 10; A100, L40 or SM120 take its fallback)."""
    return device_type == "cpu" or (device_type == "cuda" and capability is not None and capability[0] in (9, 10))


def grouped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x @ w[e].T for each expert e's rows of x, in one kernel."""
    w = ZeroGradOfEmpty.apply(w, counts > 0)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=counts.cumsum(0).to(torch.int32))


class ZeroGradOfEmpty(torch.autograd.Function):
    """`w` (experts, out, in) unchanged, and in backward its gradient exactly zero for every expert that had no slot
    (`used` False), whatever the kernel gave it: Blackwell's grouped GEMM writes non-zero weight gradients for empty
    groups (pytorch/pytorch#172439), which AdamW would then apply to experts no token chose. A select, not a
    multiply by the mask: zero even where the kernel wrote inf or NaN; the used experts' bits untouched."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(used)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (used,) = ctx.saved_tensors
        return grad.masked_fill(~used.view(-1, 1, 1), 0), None


def looped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """grouped(), one matmul per expert (the counts are read on the host: one sync per call on a device)."""
    rows = x.split(counts.tolist())
    return torch.cat([part @ w[e].T for e, part in enumerate(rows)]) if rows else x.new_empty(0, w.shape[1])


class MoE(nn.Module):
    """The mixture: router, routed experts and, optionally, shared experts (`shared`, a feed-forward module of the
    model's own taking (tokens..., dim))."""

    # Whether a training forward counts its slots and auxiliary loss: off around a forward that trains nothing but
    # runs with gradients (a pipeline schedule's metadata inference, parallel/pipeline.py).
    counting = True

    def __init__(self, dim: int, hidden: int, args: MoEArgs, shared: nn.Module | None = None):
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(dim, hidden, args.num_experts)
        self.shared_experts = shared
        # The auxiliary loss and the router z-loss: their factors (1 / (MoE layers x the global batch's sequences, or
        # its tokens), set by training/expert_load.py), the gradient backward gives them (the loss scale: 1, or fp16's,
        # set by the step), and their sums since the load was last read.
        self.aux_scale, self.z_scale, self.aux_seed = 1.0, 1.0, 1.0
        self.register_buffer("aux_sum", torch.zeros(()), persistent=False)
        self.register_buffer("z_sum", torch.zeros(()), persistent=False)
        self.register_buffer("drop_sum", torch.zeros(()), persistent=False)  # slots over capacity since read
        # Where a sequence's tokens are split across ranks (context, or TP's sequence parallelism), the sum over those
        # ranks of a tensor, and the slots at earlier positions that the other ranks hold (capacity.kept's
        # `elsewhere`, with `seq_len`, the whole sequence's): set from outside (parallel/parallelize.py); None where
        # each rank holds whole sequences.
        self.sum_over_sequence = self.earlier_slots = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, k = x.shape, self.args.top_k
        tokens = x.reshape(-1, shape[-1])
        weights, experts, scores, logits = self.router(tokens)
        # Each token's k slots, sorted by expert; stable, so an expert's slots keep the tokens' order.
        flat = experts.flatten()
        # Not bincount, whose length depends on the data: a shape fake tensors and compile can know beforehand.
        counts = torch.zeros(self.args.num_experts, dtype=flat.dtype, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        # With a capacity (in training mode: generation computes every slot), the dropped slots sort after every
        # expert's and are cut off; the experts get the kept ones. Without, the code runs as it always did.
        keep = self.within_capacity(experts, shape) if self.args.capacity_factor > 0 and self.training else None
        if keep is None:
            order, sent = flat.argsort(stable=True), counts
        else:
            kept, keep = capacity.kept_count(keep), keep.flatten()
            order = flat.masked_fill(~keep, self.args.num_experts).argsort(stable=True)[:kept]
            sent = torch.zeros_like(counts).scatter_add_(0, flat, keep.to(flat.dtype))
        # The auxiliary losses are computed in activation checkpointing's recompute too, which must save what the
        # forward saved; they are counted, as the tokens are, in training's forward only: not validation's, and not
        # the recompute in backward, which would count a block's tokens twice. They are trained through the router's
        # weights, whose backward gives them their gradient wherever this layer's output goes: as if added to the
        # model's loss, on a pipeline stage before the last too.
        a, compiled, training = self.args, torch.compiler.is_compiling(), torch.is_grad_enabled()
        if training and (a.aux_loss_coeff > 0 or a.router_z_loss > 0):
            terms = []
            if a.aux_loss_coeff > 0:
                sequences = shape[0] if x.dim() == 3 else 1
                # Its f counts each token's top k of the scores alone, as DeepSeek-V3's sequence-wise loss writes it,
                # whatever the selection bias and the groups chose; without them, that is the experts chosen.
                counted = experts if a.load_balance_coeff == 0 and a.n_group == 1 else scores.topk(k, dim=-1).indices
                aux = self.aux_scale * balance_loss(scores.view(sequences, -1, scores.shape[-1]),
                                                    counted.view(sequences, -1), k, self.sum_over_sequence)
                terms.append(a.aux_loss_coeff * aux)
            if a.router_z_loss > 0:  # linear in the tokens: each rank's share adds up, however they are split
                z = self.z_scale * router_z_loss(logits)
                terms.append(a.router_z_loss * z)
            weights = WithLoss.apply(weights, sum(terms), self.aux_seed)
        # Eager, a recompute runs inside backward's graph task, which the check sees. Compiled, the check does not
        # trace and is not needed: the count is a mutation of a buffer, which AOTAutograd applies once after the
        # forward graph and never in the backward graph, where a compiled block's recompute runs (checkpointing is
        # applied inside compile: parallel/parallelize.py); grad mode is a guard, so validation's graph counts nothing.
        # add_, not +=: the attribute's reassignment is a side effect a compiled checkpoint refuses.
        if torch.is_grad_enabled() and self.counting and (compiled or torch._C._current_graph_task_id() == -1):
            self.router.tokens_per_expert.add_(counts)  # the router's choices, dropped slots too (docs/moe.md)
            if keep is not None:
                self.drop_sum.add_((~keep).sum())
            if a.aux_loss_coeff > 0:
                self.aux_sum.add_(aux.detach())
            if a.router_z_loss > 0:
                self.z_sum.add_(z.detach())
        out = self.experts(tokens[order // k], sent)
        # Summed in x's shape, not viewed into it after: a module's output that is a view lets an in-place op on it
        # skip FSDP's pre-backward hook (FSDP2 warns of it where it wraps this module, as under TP). A dropped slot's
        # output is zero: it adds nothing to its token's, and its weight gets no gradient.
        routed = torch.empty_like(out) if keep is None else out.new_zeros(flat.numel(), out.shape[-1])
        routed = routed.index_copy_(0, order, out).view(*shape[:-1], k, shape[-1])
        y = (routed.float() * weights.view(*shape[:-1], k, 1)).sum(-2).to(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def within_capacity(self, experts: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Which of the slots `experts` (tokens, k) their experts take (capacity.py), (sequences, tokens, k): the
        capacity is of the whole sequence, however many ranks hold parts of it."""
        a, split = self.args, self.earlier_slots
        local = experts.view(shape[0] if len(shape) == 3 else 1, -1, a.top_k)
        whole = local.shape[1] if split is None else split.seq_len
        limit = capacity.capacity(a.capacity_factor, whole, a.top_k, a.num_experts)
        return capacity.kept(local, a.num_experts, limit, split)

    def init_weights(self, init, out_std: float) -> None:
        init(self.router.gate.weight, out_std)
        for buffer in self.buffers():
            buffer.zero_()
        self.experts.init_weights(init, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init, out_std)


def balance_loss(scores: torch.Tensor, experts: torch.Tensor, k: int, sum_over_sequence=None) -> torch.Tensor:
    """The Switch/Mixtral auxiliary loss, summed over sequences, each sequence's from its own tokens: E x sum over e of
    (its slots routed to e / its tokens) x (its mean normalized score of e), as transformers' Mixtral computes it for
    one sequence and one layer; k when the experts are equally loaded. Per sequence, so that its value and gradient do
    not depend on how the batch is cut into ranks and micro-batches. `scores` (sequences, tokens, E), `experts`
    (sequences, tokens x k).

    Where a sequence's tokens are split across ranks (`sum_over_sequence`, their sum), its slots are summed over them
    first, and each rank returns its tokens' share of the second factor's mean: the loss is linear in it, so the ranks'
    values add up to the whole sequence's, as do their gradients (the slots, counts, carry none)."""
    sequences, _, e = scores.shape
    slots = torch.zeros(sequences, e, device=scores.device).scatter_add_(
        1, experts, torch.ones(experts.shape, device=scores.device))
    if sum_over_sequence is not None:
        sum_over_sequence(slots)
    length = slots.sum(-1, keepdim=True) / k  # the sequence's tokens, on every rank that holds some of them
    probs = (scores / scores.sum(-1, keepdim=True)).sum(1) / length  # softmax's already sum to 1; sigmoid's normalized
    return e * (slots / length * probs).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss of the gate logits (tokens, experts), summed over the tokens: each token's log-sum-exp
    squared (the mean over a batch's tokens is the caller's factor)."""
    return logits.logsumexp(-1).square().sum()


class WithLoss(torch.autograd.Function):
    """`x` unchanged, and in backward a loss term `aux` (a scalar) given the gradient `seed` beside x's: the term is
    trained wherever x's gradient flows, without being added to the model's loss, which under pipeline parallelism
    the stages before the last never see (DeepSeek's AddAuxiliaryLoss does the same). Under non-reentrant activation
    checkpointing the forward's graph is the one backward runs, so the term gets its gradient once."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, seed) -> torch.Tensor:
        ctx.seed, ctx.aux = seed, (aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dtype, device = ctx.aux
        return grad, torch.as_tensor(ctx.seed, dtype=dtype, device=device), None


def inactive_params(model: nn.Module) -> int:
    """The routed experts' parameters a token does not use, (experts - k) / experts of them: what MFU's FLOPs leave
    out (works on meta tensors)."""
    return sum(p.numel() * (m.args.num_experts - m.args.top_k) // m.args.num_experts
               for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters())
