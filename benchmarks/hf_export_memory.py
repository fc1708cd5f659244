"""Peak memory of a Hugging Face export (and import) against the checkpoint's size: both stream one tensor at a time.

    python benchmarks/hf_export_memory.py [--dim 768] [--layers 12] [--vocab 8192] [--folder ./outputs/hf_bench]

Writes a DCP checkpoint of a ~390 MB fp32 model (random weights: the values do not matter here), then runs three
fresh processes: the imports a conversion needs and nothing else (the baseline); the export to a Hugging Face folder
(tools/hf_convert.export_to_hf, what scripts/convert_to_hf.py runs, one output file); and the import of that folder
back to DCP. Each reports its peak resident memory (ru_maxrss, which counts every page it ever held at once). A
conversion's peak above the baseline should be a few copies of the largest tensor (DCP's read buffer, the tensor,
its Hugging Face layout), not the model.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import warnings


MiB = 2**20


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(mode: str, folder: str, args) -> None:
    """One measured process: prints its peak RSS in bytes as its last line."""
    from torchtitan_lite.tools.hf_convert import export_to_hf, import_from_hf

    if mode == "export":
        export_to_hf(os.path.join(folder, "dcp"), os.path.join(folder, "hf"), model_args(args), bos_id=0, eos_id=1)
    elif mode == "import":
        import_from_hf(os.path.join(folder, "hf"), os.path.join(folder, "dcp_again"))
    print(peak_rss())


def model_args(args):
    from torchtitan_lite.models.llama3.model import ModelArgs

    return ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, vocab_size=args.vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--folder", default="./outputs/hf_bench")
    parser.add_argument("--child", choices=("baseline", "export", "import"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.folder, args)

    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_lite.models.llama3.model import Transformer
    from torchtitan_lite.models.registry import get
    from torchtitan_lite.tools.hf_convert import expected_shapes

    shutil.rmtree(args.folder, ignore_errors=True)
    os.makedirs(args.folder)
    with torch.device("meta"):
        model = Transformer(model_args(args))
    model.to_empty(device="cpu")  # uninitialized memory: fine, only the sizes are measured
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model.state_dict(), "train_state": {"step": 1}},
                 checkpoint_id=os.path.join(args.folder, "dcp"), no_dist=True)
    del model
    ckpt_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(args.folder, "dcp"))
                     for f in fs)
    largest = max(torch.Size(s).numel() for s in expected_shapes(get("llama3"), model_args(args)).values()) * 4

    def measure(mode: str) -> int:
        cmd = [sys.executable, __file__, "--child", mode, "--folder", args.folder, "--dim", str(args.dim),
               "--layers", str(args.layers), "--vocab", str(args.vocab)]
        return int(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])

    baseline, export, back = measure("baseline"), measure("export"), measure("import")
    print(f"checkpoint {ckpt_bytes / MiB:.0f} MiB, largest tensor {largest / MiB:.1f} MiB")
    print(f"peak RSS: baseline (imports) {baseline / MiB:.0f} MiB, export {export / MiB:.0f} MiB, "
          f"import {back / MiB:.0f} MiB")
    print(f"hf import peak RSS above baseline: {(back - baseline) / MiB:.0f} MiB")
    print(f"hf export peak RSS above baseline: {(export - baseline) / MiB:.0f} MiB for a {ckpt_bytes / MiB:.0f} MiB "
          "checkpoint")


if __name__ == "__main__":
    main()
