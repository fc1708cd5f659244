"""Per-rank activation memory of one long sequence under context parallelism, CP 1, 2 and 4, measured on real gloo
processes, beside the ideal 1/cp.

    python benchmarks/context_parallel_memory.py [--seq_len 16384]

Each degree is a torchrun job of this file (CUDA_VISIBLE_DEVICES="", --standalone): the debug model in fp32, its
attention swapped for context_parallel.Attend on a cp mesh as parallelize() does (no FSDP: every rank holds the same
weights, and the activations are what is measured), one forward and backward of 1 x seq_len tokens, each rank
taking its headtail share. Activations: the distinct storages autograd saves for backward during the forward and
the loss (saved_tensors_hooks; parameters excluded), which is what a rank holds at the end of forward, its
activation peak; the largest over the ranks. Of them, two are reported apart: the gathered keys and values (each
block keeps the whole sequence's for its backward: the cost of all-gather CP over ideal) and the CPU's float causal
masks (one per chunk, shared by the blocks; the GPU's flash kernel applies the mask itself and keeps none), which the
"GPU-like" column leaves out. 16,384 tokens is about the longest the debug model trains on this machine in
reasonable time (a step at CP 1 takes ~15-30 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEGREES = (1, 2, 4)
VOCAB = 2048


def measure(seq_len: int, out: Path) -> None:
    """One rank of a CP job: one step, its activation bytes; rank 0 writes the largest over the ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
    from torchtitan_lite.parallel.context_parallel import apply_cp, sharder
    from torchtitan_lite.training.step import token_loss

    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))
    args = FLAVORS["debugmodel"].with_(vocab_size=VOCAB, max_seq_len=seq_len)
    model = Transformer(args)
    model.init_weights(seed=0)
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    if cp > 1:
        apply_cp(model, mesh, seq_len, "headtail")
    share = sharder(mesh, seq_len, "headtail") or (lambda x: x)
    tokens = torch.randint(0, VOCAB, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = share(tokens[:, :-1]), share(tokens[:, 1:])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = token_loss(model(inputs), labels, seq_len)  # the trainer's loss (step.py)
    loss.backward()
    seconds = time.perf_counter() - start
    attend = model.layers["0"].attention.attend
    masks = sum(call[2].untyped_storage().nbytes() for call in attend.calls) if cp > 1 else 0
    figures = torch.tensor([sum(saved.values()), masks, seconds], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    dist.all_reduce(loss)
    if dist.get_rank() == 0:
        gathered = args.n_layers * seq_len * 2 * args.kv_heads * args.head_dim * 4 if cp > 1 else 0
        out.write_text(json.dumps({"activations": figures[0].item(), "masks": figures[1].item(),
                                   "seconds": figures[2].item(), "gathered": gathered, "loss": loss.item()}))
    dist.destroy_process_group()


def main(seq_len: int) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in DEGREES:
            out = Path(tmp) / f"cp{cp}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}", __file__,
                   "--job", str(seq_len), str(out)]
            subprocess.run(cmd, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True)
            results[cp] = json.loads(out.read_text())
    mib, base = 2**20, results[1]["activations"]
    print(f"debug model, fp32, 1 x {seq_len:,} tokens; activation bytes per rank (the largest rank), MiB")
    print(f"{'CP':>3} {'tokens/rank':>12} {'measured':>9} {'gathered K/V':>13} {'CPU masks':>10} {'GPU-like':>9} "
          f"{'ratio to CP 1':>14} {'ideal 1/cp':>11} {'step s':>7} {'loss':>10}")
    for cp, r in results.items():
        gpu = r["activations"] - r["masks"]
        print(f"{cp:>3} {seq_len // cp:>12,} {r['activations'] / mib:>9.1f} {r['gathered'] / mib:>13.1f} "
              f"{r['masks'] / mib:>10.1f} {gpu / mib:>9.1f} {gpu / base:>14.3f} {1 / cp:>11.3f} "
              f"{r['seconds']:>7.1f} {r['loss']:>10.6f}")
    for cp in DEGREES[1:]:
        r = results[cp]
        over, extra = (r["activations"] - r["masks"]) - base / cp, r["gathered"] * (1 - 1 / cp)
        print(f"CP {cp}: {over / mib:.1f} MiB over ideal; the gathered K/V account for {extra / mib:.1f} MiB of it "
              f"(each rank keeps the whole sequence's {r['gathered'] / mib:.1f} MiB, {r['gathered'] / base:.1%} of CP "
              f"1's activations, where 1/cp of it would be its share)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--job"]:
        measure(int(sys.argv[2]), Path(sys.argv[3]))
    else:
        main(int(sys.argv[sys.argv.index("--seq_len") + 1]) if "--seq_len" in sys.argv else 16384)
