"""Import a Hugging Face folder (a downloaded Llama 3.x; Qwen3 with --model qwen3) as a DCP checkpoint to train from.

    python scripts/convert_from_hf.py Llama-3.1-8B llama31_8b [--dtype float32] [--model llama3]

OUT becomes a weights-only DCP checkpoint (keys `model.*`, loadable on any mesh) holding, when the folder has a
tokenizer (tokenizer.json or original/tokenizer.model), that tokenizer as OUT/tokenizer.tiktoken. The script then prints
the config lines that start a run from it: the flavor of that shape, or, when no flavor has it, the FLAVORS entry to add
(the config names a flavor; it cannot set model dimensions). --dtype defaults to float32, the trainer's master weights;
--model, the registered model whose Hugging Face adapter reads the folder, to llama3. Folders with features our model
lacks (biases, another activation or RoPE variant, quantization) are refused. Exit status: 0 on success, 2 when the
folder cannot be converted (one line says why).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from torchtitan_lite.config import ConfigError
from torchtitan_lite.models.spec import Args, ConversionError
from torchtitan_lite.runtime.precision import DTYPES
from torchtitan_lite.tools.hf_convert import DEFAULT_MODEL, adapter, import_from_hf

TOKENIZER_FILE = "tokenizer.tiktoken"


def flavor_entry(args: Args, name: str) -> str:
    """`"name": ModelArgs(...)` (the args' class), with the fields that differ from its defaults (vocab and length
    are the run's)."""
    cls = type(args)
    default = cls()
    fields = [f"{f.name}={getattr(args, f.name)!r}" for f in dataclasses.fields(cls)
              if f.name not in ("vocab_size", "max_seq_len") and getattr(args, f.name) != getattr(default, f.name)]
    return f'"{name}": {cls.__name__}({", ".join(fields)}),'


def config_lines(args: Args, out: str, tokenizer: str | None, name: str, model: str = DEFAULT_MODEL) -> str:
    """The TOML that starts a training run of `model` (model.name) from the converted checkpoint."""
    spec, hf = adapter(model)
    flavor, lines, settings = hf.flavor_of(args), [], []
    if flavor is None and hasattr(args, "mtp_depth"):  # a flavor's shape at another MTP depth: model.mtp_depth sets it
        depths = sorted({f.mtp_depth for f in spec.flavors.values()})
        flavor = next((f for d in depths if (f := hf.flavor_of(dataclasses.replace(args, mtp_depth=d)))), None)
        settings = [f"mtp_depth = {args.mtp_depth}"] if flavor else []
    if flavor is None:
        flavor = name
        where = type(args).__module__.replace(".", "/") + ".py"  # the flavors live beside the args' class
        lines += [f"# No flavor has this shape: add it to FLAVORS in {where} first:",
                  f"#     {flavor_entry(args, name)}"]
    if tokenizer is None:
        lines.append(f"# The folder has no tokenizer: model.tokenizer_path must give {args.vocab_size} ids"
                     + (' (tokenizer_path = "" does: bytes)' if args.vocab_size == 258 else ""))
    lines += ["[model]", f"name = {json.dumps(model)}", f"flavor = {json.dumps(flavor)}", *settings]
    lines += [f"tokenizer_path = {json.dumps(tokenizer)}"] if tokenizer is not None else []
    lines += ["", "[checkpoint]", f"initial_load_path = {json.dumps(out)}"]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("hf_dir", help="Hugging Face folder: config.json and model*.safetensors")
    p.add_argument("out", help="DCP checkpoint folder to create (must not exist, or be empty)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the registered model (model.name) the folder holds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    hf_dir = Path(args.hf_dir)
    has_tokenizer = (hf_dir / "tokenizer.json").is_file() or (hf_dir / "original" / "tokenizer.model").is_file()

    def add_tokenizer(folder: Path, model_args: Args) -> None:
        # Imported here, not at the top: checking and converting the weights need none of it.
        from torchtitan_lite.data.hf_tokenizer import load_hf_tokenizer

        try:
            n_words = load_hf_tokenizer(hf_dir, folder / TOKENIZER_FILE).n_words
        except (OSError, ValueError) as e:
            raise ConversionError(f"tokenizer: {e}") from None
        if n_words != model_args.vocab_size:  # the trainer sizes the embedding from the tokenizer
            raise ConversionError(f"{hf_dir}: the tokenizer has {n_words} ids but config.json's vocab_size is "
                                  f"{model_args.vocab_size}")

    try:
        model_args = import_from_hf(hf_dir, args.out, DTYPES[args.dtype], add_tokenizer if has_tokenizer else None,
                                    model=args.model)
    except (ConversionError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}; to train from it, use these config lines:\n")
    tokenizer = str(Path(args.out) / TOKENIZER_FILE) if has_tokenizer else None
    print(config_lines(model_args, args.out, tokenizer, hf_dir.resolve().name, args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
