"""A mixture of experts' load, once a step: what each MoE layer's experts received, and DeepSeek-V3's
auxiliary-loss-free balancing, as torchtitan does it.

Each router counts the slots it sends to each expert in the step's forward passes (models/common/moe.py: its training
forward only, not validation's or activation checkpointing's recompute, in compiled blocks too). After every update,
applied or skipped (Update.after_step), the counts of all layers are summed over the ranks that saw different tokens, in
one all-reduce of layers x experts, so every rank holds the step's global load. With moe.load_balance_coeff > 0 each
layer's bias then moves the busy experts' scores down and the idle ones' up by that step, centred:
b += c * sign(mean - load), less its mean. The counts are integers, exact in fp32 up to 2^24 slots an expert a step, and
the bias a function of them alone, so it is the same bits on every layout. The load is logged at logging steps (per MoE
layer, the busiest expert's slots over the mean; and every slot counted, which a double count would show), read with the
step's other figures, and so is the Switch/Mixtral auxiliary loss (moe.aux_loss_coeff > 0; models/moe.balance_loss): a
mean over the global batch's sequences, each sequence's from its own tokens, and over the MoE layers, whose factor is
set here; and ST-MoE's router z-loss (moe.router_z_loss > 0), a mean over the global batch's tokens and the MoE layers.

With a capacity factor (models/common/capacity.py) the counts are still the router's choices, the slots dropped over
capacity among them: the bias is there to even out the routing that makes the drops, and counting the kept slots
alone would show an overloaded expert at its capacity, hiding the overload it must correct (Megatron counts the kept
ones). The dropped slots are counted apart and logged as `dropped`, their fraction of the step's slots.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_lite.models.init import canonical_name
from torchtitan_lite.models.common.moe import MoE


class ExpertLoad:
    def __init__(self, model: nn.Module, group: Callable[[], dist.ProcessGroup | None], sequences: int = 1,
                 stages: dist.ProcessGroup | None = None, device: torch.device = torch.device("cpu"),
                 seq_len: int = 1):
        """`group`: gives the ranks whose tokens differ (data, context and sequence parallel: ParallelDims.token_mesh),
        None on one; called for a model with MoE layers alone (a flattened group costs every rank its creation).
        `sequences`: the global batch's, over which the auxiliary loss is a mean (and over the MoE layers); the router
        z-loss's is over their tokens, `seq_len` each.
        `stages`: under pipeline parallelism, the pp ranks, whose stages hold different layers: the number of MoE
        layers, the slots and the auxiliary loss logged are summed over them (the load per layer is rank 0's)."""
        self.layers = [(canonical_name(name), m) for name, m in model.named_modules() if isinstance(m, MoE)]
        self.stages, self.device, total = stages, device, torch.tensor(float(len(self.layers)), device=device)
        if stages is not None:  # once, at start
            dist.all_reduce(total, group=stages)
        self.total = int(total.item())
        for _, layer in self.layers:
            layer.aux_scale, layer.z_scale = 1 / (sequences * self.total), 1 / (sequences * seq_len * self.total)
        self.group, self.load, self.totals = group() if self.total else None, None, None
        self.aux_on = any(layer.args.aux_loss_coeff > 0 for _, layer in self.layers)
        self.z_on = any(layer.args.router_z_loss > 0 for _, layer in self.layers)

    @torch.no_grad()
    def __call__(self) -> None:
        if not self.total:
            return
        routers = [layer.router for _, layer in self.layers]
        # Every layer's counts, auxiliary loss, router z-loss, dropped slots and whether it has a capacity, in one
        # all-reduce: (layers, experts + 4).
        load = torch.stack([torch.cat([r.tokens_per_expert, torch.stack([layer.aux_sum, layer.z_sum, layer.drop_sum]),
                                       torch.tensor([float(layer.args.capacity_factor > 0)], device=self.device)])
                            for r, (_, layer) in zip(routers, self.layers)]) if self.layers else None
        if self.group is not None and load is not None:
            dist.all_reduce(load, group=self.group)
        if load is not None:
            for router, counts in zip(routers, load[:, :-4]):
                if router.args.load_balance_coeff > 0:
                    delta = router.args.load_balance_coeff * torch.sign(counts.mean() - counts)
                    router.expert_bias += delta - delta.mean()
                router.tokens_per_expert.zero_()
            for _, layer in self.layers:
                layer.aux_sum.zero_()
                layer.z_sum.zero_()
                layer.drop_sum.zero_()
        # The slots, the auxiliary losses and the dropped slots of all layers, and the layers with a capacity: under PP
        # summed over the stages (a stage may hold none).
        totals = torch.zeros(5, device=self.device) if load is None else torch.cat(
            [load[:, :-4].sum().view(1), load[:, -4:].sum(0)]).to(self.device)
        if self.stages is not None:
            dist.all_reduce(totals, group=self.stages)
        self.load, self.totals = (None if load is None else load[:, :-4]), totals

    def fields(self) -> dict[str, float]:
        """The last step's load: per layer (this rank's stage's under PP), its busiest expert's slots over the mean;
        the slots counted in all layers; the auxiliary loss and router z-loss (before their coefficients) when on; and
        with a capacity factor, the fraction of the slots dropped."""
        if self.totals is None:
            return {}
        slots, aux, z, dropped, capacities = self.totals.tolist()
        # A stage of dense blocks alone: the others' say (a loss that is on is positive).
        aux_on, z_on = (self.aux_on, self.z_on) if self.layers else (aux > 0, z > 0)
        out = {"routed_slots": slots, **({"aux_loss": aux} if aux_on else {}), **({"router_z_loss": z} if z_on else {})}
        if capacities:  # summed over every rank and stage, so every rank knows, whichever layers it holds
            out["dropped"] = dropped / slots
        if self.load is not None:
            busiest = (self.load.max(1).values / self.load.mean(1)).tolist()
            out |= {f"expert_load/{name}": b for (name, _), b in zip(self.layers, busiest)}
        return out
