"""Every token's routing decision at step 1, for the parity tests of mixture-of-experts layouts: routing is
discontinuous (a score difference of one rounding can flip a token's top-k choice, and a flipped token moves the
curve by more than rounding), so a layout's numbers are compared with one process's only once every token is known to
have gone to the same experts.

grad_dump.recording starts a RouteRecorder: rank R writes OUT_DIR/routes.R.pt, {MoE layer: [(global sequence index,
its tokens' experts (seq, k), their margins (seq,), their positions in the sequence)]}; a token's margin is how far
its k-th expert's score is above the best one it did not choose. A sequence is named by its index in the data's one
global order (data/loader.py: dp rank r takes a contiguous slice of the step's windows and cuts it into
micro-batches), and where a sequence is split across ranks each records the positions of the tokens it routes
(context parallelism's cut, the loader's or the step's; then sequence parallelism's, TP rank t holding the t-th
contiguous part, the tp dim being the mesh's innermost), so any layout's records line up with one process's.
`load_routes` joins the ranks' files.
"""

import os
from pathlib import Path

import torch

from torchtitan_lite.data.loader import DataLoader
from torchtitan_lite.models.common import moe


class RouteRecorder:
    def __init__(self, out: Path):
        self.out, self.routes, self.sequences, self.local, self.names, self.patched = out, {}, [], 1, {}, []
        self.positions = None  # of the tokens of each sequence this rank's loader holds
        # Context parallelism's cut of a sequence on this rank (grad_dump.recording: train.sharder's), made by the
        # loader, or by the step where it needs whole windows first (block_causal, multi-token prediction).
        self.ranges = None

    def start(self, models: list, first_step) -> None:
        self.names = {id(m.router): n for model in models for n, m in model.named_modules() if isinstance(m, moe.MoE)}
        if self.patched or not self.names:
            return
        forward, moe_forward, next_batch = moe.Router.forward, moe.MoE.forward, DataLoader.next_batch

        def recording_forward(router, x):
            weights, experts, scores, logits = forward(router, x)
            # A training forward's call (not validation's, or a pipeline's metadata inference), not activation
            # checkpointing's recompute of it in backward; not one traced into a compiled block's graph, which runs
            # no Python (a router compiled whole records nothing; under expert parallelism it runs eager).
            if not torch.compiler.is_compiling() and first_step() and moe.MoE.counting and \
                    torch.is_grad_enabled() and torch._C._current_autograd_node() is None:
                self._record(router, x, experts)
            return weights, experts, scores, logits

        def recording_moe_forward(layer, x):
            if not torch.compiler.is_compiling():  # a compiled checkpoint refuses the side effect (and records nothing)
                self.local = x.shape[0] if x.dim() == 3 else 1  # the call's sequences: a pipeline cuts micro-batches
            return moe_forward(layer, x)

        def recording_next_batch(loader):
            if not first_step():
                return next_batch(loader)
            per_rank, leaf = loader.global_batch // loader.dp_size, loader.interleave
            if leaf:  # leaf t of rank r is the batch's t * dp + r (training.layout_invariant)
                self.sequences = [loader.position + (t * loader.dp_size + loader.dp_rank) * leaf + i
                                  for t in range(per_rank // leaf) for i in range(leaf)]
            else:
                first = loader.position + loader.dp_rank * per_rank
                self.sequences = [first + i for i in range(per_rank)]
            batches = next_batch(loader)
            self.positions = (torch.arange(batches[0][0].shape[1]) if self.ranges is None else
                              torch.cat([torch.arange(start, stop) for start, stop in self.ranges]))
            return batches

        self.patched = [(moe.Router, "forward", forward), (moe.MoE, "forward", moe_forward),
                        (DataLoader, "next_batch", next_batch)]
        moe.Router.forward, moe.MoE.forward, DataLoader.next_batch = (recording_forward, recording_moe_forward,
                                                                      recording_next_batch)

    def _record(self, router, x: torch.Tensor, experts: torch.Tensor) -> None:
        """One micro-batch's call of one layer's router: its sequences are the next `local` of this rank's (under a
        pipeline, each stage's calls go through the micro-batches in order)."""
        a = router.args
        with torch.no_grad():  # nothing saved for backward: activation checkpointing counts what the forward saves
            logits = router.gate(x).float()
            scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
            scores = scores + getattr(router, "expert_bias", 0)  # what chooses (zero at step 1)
            top = scores.topk(min(a.top_k + 1, a.num_experts), dim=-1).values
        margin = top[:, a.top_k - 1] - (top[:, a.top_k] if a.top_k < a.num_experts else 0)
        calls = self.routes.setdefault(self.names[id(router)], [])
        rows = experts.shape[0] // self.local  # a sequence's tokens here
        parts = len(self.positions) // rows  # sequence parallelism's, of what this rank's loader holds
        t = int(os.environ.get("RANK", "0")) % parts
        for i, seq in enumerate(self.sequences[len(calls):len(calls) + self.local]):
            calls.append((seq, experts[i * rows:(i + 1) * rows].detach().clone(),
                          margin[i * rows:(i + 1) * rows].detach().clone(), self.positions[t * rows:(t + 1) * rows]))

    def stop(self) -> None:
        for owner, name, original in self.patched:
            setattr(owner, name, original)
        if self.patched:
            torch.save(self.routes, self.out / f"routes.{os.environ.get('RANK', '0')}.pt")


def load_routes(out: Path) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """MoE layer -> global sequence index -> (its tokens' experts, their margins) in the sequence's order, from every
    rank's file (the parts of a sequence that context-parallel ranks hold, joined)."""
    parts = {}
    for f in sorted(out.glob("routes.*.pt")):
        for layer, calls in torch.load(f).items():
            for seq, experts, margin, positions in calls:
                parts.setdefault(layer, {}).setdefault(seq, []).append((experts, margin, positions))
    routes = {}
    for layer, sequences in parts.items():
        for seq, held in sequences.items():
            experts, margin, positions = (torch.cat(x) for x in zip(*held))
            order = positions.argsort()
            assert torch.equal(positions[order], torch.arange(len(positions))), f"{layer}, sequence {seq}: {positions}"
            routes.setdefault(layer, {})[seq] = (experts[order], margin[order])
    return routes


def assert_same_routes(got: dict, ref: dict, layout: str) -> tuple[float, float]:
    """Every token of every sequence of the step went to the same experts in the same order; returns the smallest
    margin seen (how close a token came to a flip) and the largest difference of a margin from one process's (how far
    the layout moved the scores at the decision)."""
    assert got.keys() == ref.keys() and got, f"MoE layers {sorted(got)} against {sorted(ref)}"
    smallest, moved = float("inf"), 0.0
    for layer, sequences in ref.items():
        assert got[layer].keys() == sequences.keys(), f"{layer}: sequences {sorted(got[layer])} vs {sorted(sequences)}"
        for seq, (experts, margin) in sequences.items():
            flipped = (got[layer][seq][0] != experts).any(-1).nonzero().flatten().tolist()
            if flipped:
                t = flipped[0]
                raise AssertionError(f"a flipped routing decision, not a wrong number: on {layout}, {layer}, sequence "
                                     f"{seq}, token {t} went to experts {got[layer][seq][0][t].tolist()}, on one "
                                     f"process to {experts[t].tolist()} (its margin {margin[t].item():.2e})")
            smallest = min(smallest, margin.min().item())
            moved = max(moved, (got[layer][seq][1] - margin).abs().max().item())
    return smallest, moved
