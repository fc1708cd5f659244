"""train.py with a second architecture registered: a toy language model that is no Llama, so a test can show that a
model is a folder behind a spec (torchtitan_lite/models/spec.py) and nothing more. torchrun's workers are new
processes, so the registration happens here, in each of them, before train.run().

    toy_model.py TRAIN_ARGS...      (with --model.name toy; flavor "tiny")

Its blocks are pre-norm MLPs alone, no attention (a bigram model with depth); its modules have names of their own
(embed, final_norm, head) and its TP plan is its own: a layer that still assumed Llama would look for `attention.wq`.
"""

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from torchtitan_lite.models import registry
from torchtitan_lite.models.init import canonical_name, trunc_normal_
from torchtitan_lite.models.spec import ModelSpec, TPStyles


@dataclass(frozen=True)
class ToyArgs:
    dim: int = 64
    hidden: int = 256
    n_layers: int = 2
    vocab_size: int = -1  # the run's
    max_seq_len: int = -1


class MLPBlock(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.norm = nn.RMSNorm(args.dim)
        self.up = nn.Linear(args.dim, args.hidden, bias=False)
        self.down = nn.Linear(args.hidden, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ToyLM(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): MLPBlock(args) for i in range(args.n_layers)})
        self.final_norm = nn.RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, documents=None) -> torch.Tensor:
        h = self.embed(tokens) if self.embed is not None else tokens  # None on a later pipeline stage
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.final_norm(h)) if self.head is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device=None) -> None:
        for name, p in self.named_parameters():  # keyed by name: the same values on any mesh (models/init.py)
            name = canonical_name(name)
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                trunc_normal_(p, 1.0 if name == "embed.weight" else 0.02, math.inf, key=f"{seed}/{name}")


def tp_plan(s: TPStyles, loss_parallel: bool) -> dict:
    """Sequence parallel between blocks, each MLP gathering the sequence into its column-split `up`."""
    return {
        "embed": s.embedding(input_layouts=Replicate(), output_layouts=Shard(1)),
        "final_norm": s.sequence(),
        "head": s.colwise(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                          use_local_output=not loss_parallel),
        "layers.*.norm": s.sequence(),
        "layers.*.up": s.colwise(input_layouts=Shard(1)),
        "layers.*.down": s.rowwise(output_layouts=Shard(1)),
    }


def flops_per_token(model: ToyLM, seq_len: int) -> float:
    return 6.0 * sum(p.numel() for name, p in model.named_parameters() if name != "embed.weight")


TOY = ModelSpec(name="toy", model_class=ToyLM, flavors={"tiny": ToyArgs()}, tp_plan=tp_plan,
                tp_sizes=lambda args: {"MLP hidden size": args.hidden}, flops_per_token=flops_per_token)

if __name__ == "__main__":
    import train

    registry.register(TOY)
    sys.exit(train.run(sys.argv[1:]))
