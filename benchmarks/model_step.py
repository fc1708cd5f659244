"""Our model's training step against a plain reference implementation of the same architecture, on the CPU.

    python benchmarks/model_step.py [--model llama3|qwen3] [--reference hf|meta] [--reps 7] [--seq_len 256] [--batch 4]
    python benchmarks/model_step.py --masking [--doc_len 64]     # block_causal against causal, both ours

One step is zero_grad, forward, F.cross_entropy, backward and a foreach AdamW step, in fp32. At three sizes it times
our model (the registry's `--model`, built by its spec) and a reference of identical shapes (the parameter counts are
asserted equal; the weights differ, which changes no timing). The sizes, each its model's debugmodel flavor changed:
- llama3 (the default): the debug model 256x6, 512x4 with grouped-query attention 8/2, 1024x2 with GQA 16/4;
- qwen3: its debugmodel (QK-norm, head_dim 64, GQA 8/4, tied embeddings) in 6 blocks, 512x4 with GQA 8/2, 1024x2
  with GQA 16/4 and head_dim 128 (queries 2048 wide on dim 1024, as Qwen3-0.6B's), the feed-forward 3x dim as
  Qwen3's, embeddings tied at every size.
The references:
- hf: Hugging Face's model of the spec's own config.json (`spec.hf.config`, what our exports write: for llama3
  `LlamaForCausalLM`, untied embeddings, no bias; for qwen3 `Qwen3ForCausalLM`), SDPA attention, no KV cache; the
  default when `transformers` is installed (`pip install transformers`; it is not a requirement of the trainer);
- meta (llama3 only): a few lines in the style of Meta's llama3 reference, llama/model.py (complex-number rotary,
  repeat_kv, SDPA, SwiGLU).
Each repetition times one step of ours, then one of the reference, so drift on a shared machine hits both alike;
after warm-up steps, the figures are medians. GFLOP/s and MFU use the spec's flops_per_token and the CPU's measured
matmul peak (metrics.peak_flops), as the trainer logs them.

The last line is `model/reference speed: min X over 3 sizes`: the reference's step time over ours at the size where
ours does worst. Higher is better; >= 1.0 means ours is nowhere slower.

`--masking` times, side by side in the same way, our model with document masking (block_causal: documents of
`--doc_len` tokens, the explicit SDPA mask the CPU uses) against the same model causal, and ends with
`block_causal/causal step time: max X over 3 sizes` (1.0 = masking is free).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.models import registry
from torchtitan_lite.models.llama3.model import ModelArgs
from torchtitan_lite.models.spec import ModelSpec
from torchtitan_lite.runtime.metrics import peak_flops

# --model -> {size: the changes to the model's debugmodel flavor}
SIZES = {
    "llama3": {
        "256x6 (debugmodel)": {},
        "512x4 gqa 8/2": dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=2),
        "1024x2 gqa 16/4": dict(dim=1024, n_layers=2, n_heads=16, n_kv_heads=4),
    },
    "qwen3": {  # tied embeddings throughout (the flavor's, as the small published sizes); ffn_hidden 3x dim as theirs
        "256x6 gqa 8/4 hd64": dict(n_layers=6),
        "512x4 gqa 8/2 hd64": dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden=1536),
        "1024x2 gqa 16/4 hd128": dict(dim=1024, n_layers=2, n_heads=16, n_kv_heads=4, head_dim=128, ffn_hidden=3072),
    },
}


def hf_reference(spec: ModelSpec, a) -> nn.Module:
    """Hugging Face's model of the config.json our export of `a` writes (LlamaForCausalLM, Qwen3ForCausalLM)."""
    # Imported here: transformers is optional, for benchmarking only.
    from transformers import AutoConfig, AutoModelForCausalLM

    config = spec.hf.config(a, a.vocab_size - 2, a.vocab_size - 1, torch.float32)  # BOS, EOS: the BPE's last two
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config, use_cache=False),
                                             attn_implementation="sdpa")
    return _LogitsOnly(model)


class _LogitsOnly(nn.Module):
    """tokens -> logits, like ours, so both are driven by the same step code."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


# ---- The fallback reference, after Meta's llama3 llama/model.py (training path: no KV cache, no model parallelism).
class MetaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq), torch.view_as_real(xk_ * freqs_cis).flatten(
        3).type_as(xk)


def repeat_kv(x, n_rep: int):
    bs, seq, kv_heads, head_dim = x.shape
    return x if n_rep == 1 else x[:, :, :, None].expand(bs, seq, kv_heads, n_rep, head_dim).reshape(
        bs, seq, kv_heads * n_rep, head_dim)


class MetaBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = a.n_heads, a.kv_heads, a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.w1 = nn.Linear(a.dim, a.ffn_hidden, bias=False)
        self.w2 = nn.Linear(a.ffn_hidden, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_hidden, bias=False)
        self.attention_norm, self.ffn_norm = MetaRMSNorm(a.dim, a.norm_eps), MetaRMSNorm(a.dim, a.norm_eps)

    def forward(self, x, freqs_cis):
        bs, seq, _ = x.shape
        h = self.attention_norm(x)
        xq = self.wq(h).view(bs, seq, self.n_heads, self.head_dim)
        xk = self.wk(h).view(bs, seq, self.kv_heads, self.head_dim)
        xv = self.wv(h).view(bs, seq, self.kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        rep = self.n_heads // self.kv_heads
        q, k, v = (t.transpose(1, 2) for t in (xq, repeat_kv(xk, rep), repeat_kv(xv, rep)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(bs, seq, -1)
        h = x + self.wo(out)
        g = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(g)) * self.w3(g))


class MetaTransformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(MetaBlock(a) for _ in range(a.n_layers))
        self.norm = MetaRMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        freqs = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2)[: a.head_dim // 2].float() / a.head_dim))
        angles = torch.outer(torch.arange(a.max_seq_len).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs_cis[: tokens.shape[1]])
        return self.output(self.norm(h))


def meta_reference(spec: ModelSpec, a: ModelArgs) -> nn.Module:
    assert spec.name == "llama3", "the Meta-style reference is Llama's"
    return MetaTransformer(a)


def ours(spec: ModelSpec, a) -> nn.Module:
    model = spec.model_class(a)
    model.init_weights(seed=0)
    return model


class Masked(nn.Module):
    """Our model under block_causal with documents of `doc_len` tokens: the step's document ids, made once."""

    def __init__(self, spec: ModelSpec, a, doc_len: int):
        super().__init__()
        self.model = ours(spec, a)
        self.doc_len = doc_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        return self.model(tokens, documents=(positions // self.doc_len).expand_as(tokens))


REFERENCES = {"hf": hf_reference, "meta": meta_reference}  # name -> (spec, args) -> the reference model


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs, labels) -> float:
    """Seconds of one training step."""
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    loss.backward()
    optimizer.step()
    loss.item()
    return time.perf_counter() - start


def bench(spec: ModelSpec, args, reference: str, batch: int, reps: int, warmup: int,
          doc_len: int = 0) -> dict[str, float]:
    """`doc_len`: the reference is our model masked at documents of that many tokens (--masking)."""
    mine = ours(spec, args)
    ref = Masked(spec, args, doc_len) if doc_len else REFERENCES[reference](spec, args)
    n_params = sum(p.numel() for p in mine.parameters())  # a tied table counts once, in either model
    n_ref = sum(p.numel() for p in ref.parameters())
    assert n_ref == n_params, f"the reference has {n_ref} parameters, ours {n_params}: the shapes differ"
    tokens = torch.randint(args.vocab_size, (batch, args.max_seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    sides = [(m, torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)) for m in (mine, ref)]
    times: list[list[float]] = [[], []]
    for rep in range(warmup + reps):
        for i, (model, optimizer) in enumerate(sides):  # one step each, alternating
            dt = train_step(model, optimizer, inputs, labels)
            if rep >= warmup:
                times[i].append(dt)
    ours_s, ref_s = statistics.median(times[0]), statistics.median(times[1])
    token_flops = spec.flops_per_token(mine, args.max_seq_len)
    flops = token_flops * batch * args.max_seq_len / ours_s
    return {"params": n_params, "ours_s": ours_s, "ref_s": ref_s, "flops": flops,
            "mfu": flops / peak_flops(torch.device("cpu"), torch.float32)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_ref = "hf" if importlib.util.find_spec("transformers") else "meta"
    p.add_argument("--model", choices=tuple(SIZES), default="llama3", help="the registry's architecture")
    p.add_argument("--reference", choices=tuple(REFERENCES), default=default_ref)
    p.add_argument("--reps", type=int, default=7, help="timed steps of each model per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each model first")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2050, help="the project's BPE has 2048 ranks + BOS/EOS")
    p.add_argument("--masking", action="store_true", help="time block_causal against causal (ours both)")
    p.add_argument("--doc_len", type=int, default=64, help="--masking: tokens per document")
    a = p.parse_args()
    if a.masking:
        a.reference = "block_causal"
    elif a.model != "llama3" and a.reference == "meta":
        raise SystemExit(f"--model {a.model}: the Meta-style reference is Llama's; use --reference hf "
                         "(pip install transformers)")
    spec = registry.get(a.model)
    base = spec.args("debugmodel", a.vocab, a.seq_len)
    sizes = {name: dataclasses.replace(base, **changes) for name, changes in SIZES[a.model].items()}
    model = "" if a.model == "llama3" else f"model {a.model}, "  # llama3's first line as before --model
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, {model}reference {a.reference}, "
          f"seq {a.seq_len} x batch {a.batch}, median of {a.reps} steps after {a.warmup}", flush=True)
    fmt = "{:<%d}{:>9}{:>10}{:>10}{:>11}{:>9}{:>7}" % max(20, 1 + max(map(len, sizes)))
    print(fmt.format("size", "params", "ours ms", "ref ms", "ref/ours", "GFLOP/s", "MFU"))
    if a.masking:
        print("  (ref: block_causal, documents of %d tokens; ref/ours: its step time over causal's)" % a.doc_len)
    speeds = []
    for name, args in sizes.items():
        r = bench(spec, args, a.reference, a.batch, a.reps, a.warmup, a.doc_len if a.masking else 0)
        speeds.append(r["ref_s"] / r["ours_s"])
        print(fmt.format(name, f"{r['params'] / 1e6:.2f}M", f"{r['ours_s'] * 1e3:.1f}", f"{r['ref_s'] * 1e3:.1f}",
                         f"{speeds[-1]:.3f}", f"{r['flops'] / 1e9:.1f}", f"{100 * r['mfu']:.1f}%"), flush=True)
    if a.masking:  # "speeds" are then block_causal's step time over causal's
        print(f"block_causal/causal step time: max {max(speeds):.3f} over {len(speeds)} sizes (1.0 = free)")
    else:
        print(f"model/reference speed: min {min(speeds):.3f} over {len(speeds)} sizes (higher is better)")


if __name__ == "__main__":
    main()
