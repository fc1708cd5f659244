"""Sample text from a checkpoint: prints the prompt followed by the model's continuation.

    python scripts/generate.py --checkpoint outputs/checkpoint/step-10 --prompt "def main(" [--config FILE]
        [--max_new_tokens 32] [--temperature 0] [--top_k 50] [--seed 0] [--dtype bfloat16]

`--checkpoint` is what scripts/convert_to_hf.py takes too: a `step-N` folder, the checkpoint folder holding them or
the run's dump folder (both: the newest complete step), saved on any mesh, full state or weights only; it loads on
this one process. The model is built exactly as train.py built it (flavor, tokenizer, training.seq_len as the
context) from the `config.toml` the run wrote into its dump folder, which holds the command line's overrides too, or
from `--config`. Other `--section.key value` arguments override it, as on train.py's command line.
`--temperature 0` decodes greedily; otherwise tokens are drawn from the top_k most likely with a generator seeded by
--seed, so the same seed gives the same text (on the same machine). Decoding uses a KV cache
(torchtitan_lite/tools/generation.py). Exit status 2, with one `error:` line, on a bad config, checkpoint or length.
"""

from __future__ import annotations

import argparse
import sys

import torch

from torchtitan_lite.checkpoint.finder import checkpoint_and_config
from torchtitan_lite.config import ConfigError
from torchtitan_lite.runtime.precision import DTYPES
from torchtitan_lite.tools.generation import ContextError, generate, load_model


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a step-N folder, their checkpoint folder or the run's dump "
                   "folder (the newest complete step)")
    p.add_argument("--config", help="the run's TOML config (default: config.toml of the run's dump folder)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy (argmax)")
    p.add_argument("--top_k", type=int, default=None, help="sample among the k most likely tokens (default: all)")
    p.add_argument("--seed", type=int, default=None, help="seeds the sampling (default: a fresh random seed)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the weights' dtype for decoding")
    args, overrides = p.parse_known_args(argv)
    for name, ok in (("max_new_tokens", args.max_new_tokens >= 0), ("temperature", args.temperature >= 0),
                     ("top_k", args.top_k is None or args.top_k >= 1)):
        if not ok:
            p.error(f"--{name} must be {'>= 1' if name == 'top_k' else '>= 0'} (got {getattr(args, name)})")
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        checkpoint, cfg = checkpoint_and_config(args.checkpoint, args.config, overrides)
        model, tokenizer = load_model(cfg, checkpoint, device, DTYPES[args.dtype])
        generator = torch.Generator(device)
        if args.seed is None:
            generator.seed()
        else:
            generator.manual_seed(args.seed)
        # BOS first, as torchtitan_lite/data/files.py encodes every training document; no EOS, which would end
        # the text.
        prompt = tokenizer.encode(args.prompt, bos=True, eos=False)
        new = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, tokenizer.eos_id, generator)
    except (ConfigError, ContextError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(args.prompt + tokenizer.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
