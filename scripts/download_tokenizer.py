"""Downloads Llama 3's tiktoken file (`original/tokenizer.model`) from Hugging Face.

    python scripts/download_tokenizer.py --hf_token hf_...
    # then train with --model.tokenizer_path assets/tokenizer/original/tokenizer.model

The meta-llama repos are gated: accept the license on the model's page first, then pass a token that can read it
(or log in once with `huggingface-cli login`).
"""

import argparse

TOKENIZER_FILE = "original/tokenizer.model"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo_id", default="meta-llama/Meta-Llama-3.1-8B")
    p.add_argument("--hf_token", default=None, help="a Hugging Face access token (default: the logged-in one)")
    p.add_argument("--local_dir", default="assets/tokenizer/")
    return p


def main() -> None:
    args = parser().parse_args()

    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import HfHubHTTPError
    except ImportError:
        raise SystemExit("downloading needs huggingface_hub: pip install huggingface_hub") from None

    try:
        path = hf_hub_download(args.repo_id, TOKENIZER_FILE, local_dir=args.local_dir, token=args.hf_token)
    except HfHubHTTPError as e:
        raise SystemExit(
            f"could not download {TOKENIZER_FILE} from {args.repo_id}: {e}\n"
            "Gated repo? Accept its license on huggingface.co and pass --hf_token."
        ) from None
    print(f"downloaded {path}; use it with --model.tokenizer_path {path}")


if __name__ == "__main__":
    main()
