"""The decoder's tensor-parallel plan (decoder.py): Megatron-style TP with sequence parallelism, as one dict from
module name to style; every architecture built on the decoder takes it (a module it does not hold is passed over).

Activations between blocks are sharded on the sequence dim (Shard(1)), gathered before attention and the FFN, and
reduce-scattered after their output projections; the norms run on the sequence shards. Which classes implement each
style is the parallel layer's choice (models/spec.TPStyles: float8's for a converted block), so this file holds only
which module is split which way.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard

from torchtitan_lite.models.spec import TPStyles


def tp_plan(s: TPStyles, loss_parallel: bool) -> dict[str, Any]:
    """The whole model's plan; "layers.*." entries hold for every block."""
    return {
        "tok_embeddings": s.embedding(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": s.sequence(),
        # With loss parallel the logits stay sharded on the vocab dim: cross-entropy never gathers them.
        "output": s.colwise(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                            use_local_output=not loss_parallel),
        "layers.*.attention_norm": s.sequence(),
        # Its inputs: the hidden states, the rotary rows, the documents' mask (None when causal), alike on every rank.
        "layers.*.attention": s.prepare_input(input_layouts=(Shard(1), None, None),
                                              desired_input_layouts=(Replicate(), None, None)),
        "layers.*.attention.wq": s.colwise(),
        "layers.*.attention.wk": s.colwise(),
        "layers.*.attention.wv": s.colwise(),
        "layers.*.attention.wo": s.rowwise(output_layouts=Shard(1)),
        # QK-norm normalizes each head's queries and keys, which TP splits by head (dim 2): its weight is every
        # head's, so its gradient sums over the tp ranks' heads.
        "layers.*.attention.q_norm": s.sequence(sequence_dim=2, use_local_output=True),
        "layers.*.attention.k_norm": s.sequence(sequence_dim=2, use_local_output=True),
        "layers.*.ffn_norm": s.sequence(),
        "layers.*.feed_forward": s.prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": s.colwise(),
        "layers.*.feed_forward.w2": s.rowwise(output_layouts=Shard(1)),
        "layers.*.feed_forward.w3": s.colwise(),
        # A mixture of experts routes and computes each token on the rank that holds it (a token's route and experts
        # are its own): its sequence shard, as a plain tensor, no TP inside, and its output that shard, as the
        # residual stream holds it; its parameters are sharded over the tp ranks as over data-parallel ones, which
        # sums their gradients there (parallel/parallelize.py).
        "layers.*.moe": s.prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                        use_local_output=True),
        # A multi-token prediction module (mtp.py) is a block with these besides: its norms on the sequence shards,
        # and the projection of the two, whole on every rank (its gradient summed over the ranks' shards), handing
        # the block its sequence shard.
        "mtp.*.enorm": s.sequence(),
        "mtp.*.hnorm": s.sequence(),
        "mtp.*.eh_proj": s.replicated(use_local_output=True),
        "mtp.*.norm": s.sequence(),
    }


def mla_tp_plan(s: TPStyles, loss_parallel: bool) -> dict[str, Any]:
    """The plan of a decoder whose blocks attend by MLA (mla.py): the decoder's, with MLA's projections in place of
    the attention's. The heads split as there (the queries' and the latent's expansions colwise, the output rowwise);
    the latents' projections and norms, whose sizes are no head's, run whole on every rank on the gathered hidden
    states (replicated: their gradients sum over the ranks' heads), and the rotated key part every head shares
    enters the ranks' heads through `shared_key`."""
    attention = "layers.*.attention."
    plan = {k: v for k, v in tp_plan(s, loss_parallel).items() if not k.startswith(attention)}
    return plan | {attention + name: style for name, style in {
        "wq": s.colwise(), "wq_a": s.replicated(), "q_norm": s.replicated(), "wq_b": s.colwise(),
        "wkv_a": s.replicated(), "kv_norm": s.replicated(), "wkv_b": s.colwise(),
        "shared_key": s.replicated(use_local_output=True), "wo": s.rowwise(output_layouts=Shard(1))}.items()}


def tp_sizes(args) -> dict[str, int]:
    """What the plan splits across TP ranks: heads (query and key/value) and the FFN's hidden size."""
    return {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads, "FFN hidden size": args.ffn_hidden}
