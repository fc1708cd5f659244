"""Export a DCP checkpoint of a run as a Hugging Face folder of its model (config.json, safetensors, tokenizer).

    python scripts/convert_to_hf.py outputs/checkpoint/step-1000 hf_out [--config FILE] [--dtype bfloat16]
        [--max_shard_size 5GB]

CKPT is what scripts/generate.py's --checkpoint takes too: a `step-N` folder, the checkpoint folder holding them or
the run's dump folder (both: the newest complete step). The model's shape comes from the resolved config.toml in the
run's dump folder (a checkpoint is `<job.dump_folder>/<checkpoint.folder>/step-N`), or from --config; the
checkpoint's tensors must have exactly the shapes it gives. Any mesh the run used is fine: DCP reassembles each
tensor. --dtype defaults to the checkpoint's own.
Above --max_shard_size (default 5GB, like transformers) the weights are split into several files and an index.
Tensors are converted one at a time, into a temporary folder renamed to OUT at the end: a failure leaves no OUT.
Exit status: 0 on success, 2 when the input cannot be converted (one line says why).
"""

from __future__ import annotations

import argparse
import re
import sys

from torchtitan_lite.checkpoint.finder import checkpoint_and_config
from torchtitan_lite.config import ConfigError
from torchtitan_lite.models.spec import ConversionError
from torchtitan_lite.runtime.precision import DTYPES
from torchtitan_lite.tools.hf_convert import DEFAULT_MAX_SHARD_SIZE, export_run

# transformers' units: GB is 10^9 bytes, GiB 2^30.
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '500MiB' or a number of bytes -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB, 500MiB or 1000000 (got {text!r})")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("ckpt", help="a step-N folder, their checkpoint folder or the run's dump folder (the newest "
                   "complete step), e.g. outputs/checkpoint/step-1000")
    p.add_argument("out", help="Hugging Face folder to create (must not exist, or be empty)")
    p.add_argument("--config", help="the run's config.toml (default: config.toml of the run's dump folder)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's")
    p.add_argument("--max_shard_size", type=parse_size, default=DEFAULT_MAX_SHARD_SIZE, help="default 5GB")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        ckpt, cfg = checkpoint_and_config(args.ckpt, args.config)
        # The trainer's model and tokenizer, written beside.
        export_run(ckpt, args.out, cfg, DTYPES.get(args.dtype), args.max_shard_size)
    except (ConversionError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: load it with transformers' AutoModelForCausalLM.from_pretrained({args.out!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
