"""Our model's training step against a plain reference implementation of the same architecture, on the CPU.

    python benchmarks/model_step.py [--reference hf|meta] [--reps 7] [--seq_len 256] [--batch 4]
    python benchmarks/model_step.py --masking [--doc_len 64]     # block_causal against causal, both ours

One step is zero_grad, forward, F.cross_entropy, backward and a foreach AdamW step, in fp32. At three sizes (the
debug model 256x6, 512x4 with grouped-query attention, 1024x2 with GQA) it times our Transformer and a reference of
identical shapes (the parameter counts are asserted equal; the weights differ, which changes no timing):
- hf: Hugging Face `LlamaForCausalLM` with the same LlamaConfig (untied embeddings, no bias, SDPA attention), the
  default when `transformers` is installed (`pip install transformers`; it is not a requirement of the trainer);
- meta: a few lines in the style of Meta's llama3 reference, llama/model.py (complex-number rotary, repeat_kv, SDPA,
  SwiGLU).
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
import importlib.util
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_lite.models.llama3.model import FLAVORS, ModelArgs, Transformer
from torchtitan_lite.models.common.decoder import flops_per_token
from torchtitan_lite.runtime.metrics import peak_flops


def hf_reference(a: ModelArgs) -> nn.Module:
    # Imported here: transformers is optional, for benchmarking only.
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.ffn_hidden, num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads, num_key_value_heads=a.kv_heads, max_position_embeddings=a.max_seq_len,
        rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta, tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, hidden_act="silu", use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
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


class Masked(nn.Module):
    """Our model under block_causal with documents of `doc_len` tokens: the step's document ids, made once."""

    def __init__(self, a: ModelArgs, doc_len: int):
        super().__init__()
        self.model = Transformer(a)
        self.model.init_weights(seed=0)
        self.doc_len = doc_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        return self.model(tokens, documents=(positions // self.doc_len).expand_as(tokens))


REFERENCES = {"hf": hf_reference, "meta": MetaTransformer}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs, labels) -> float:
    """Seconds of one training step."""
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    loss.backward()
    optimizer.step()
    loss.item()
    return time.perf_counter() - start


def bench(args: ModelArgs, reference: str, batch: int, reps: int, warmup: int, doc_len: int = 0) -> dict[str, float]:
    """`doc_len`: the reference is our model masked at documents of that many tokens (--masking)."""
    ours, ref = Transformer(args), Masked(args, doc_len) if doc_len else REFERENCES[reference](args)
    ours.init_weights(seed=0)
    n_params = sum(p.numel() for p in ours.parameters())
    n_ref = sum(p.numel() for p in ref.parameters())
    assert n_ref == n_params, f"the reference has {n_ref} parameters, ours {n_params}: the shapes differ"
    tokens = torch.randint(args.vocab_size, (batch, args.max_seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    sides = [(m, torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)) for m in (ours, ref)]
    times: list[list[float]] = [[], []]
    for rep in range(warmup + reps):
        for i, (model, optimizer) in enumerate(sides):  # one step each, alternating
            dt = train_step(model, optimizer, inputs, labels)
            if rep >= warmup:
                times[i].append(dt)
    ours_s, ref_s = statistics.median(times[0]), statistics.median(times[1])
    token_flops = flops_per_token(ours, args.max_seq_len)
    flops = token_flops * batch * args.max_seq_len / ours_s
    return {"params": n_params, "ours_s": ours_s, "ref_s": ref_s, "flops": flops,
            "mfu": flops / peak_flops(torch.device("cpu"), torch.float32)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_ref = "hf" if importlib.util.find_spec("transformers") else "meta"
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
    base = FLAVORS["debugmodel"].with_(vocab_size=a.vocab, max_seq_len=a.seq_len)
    sizes = {
        "256x6 (debugmodel)": base,
        "512x4 gqa 8/2": base.with_(dim=512, n_layers=4, n_heads=8, n_kv_heads=2),
        "1024x2 gqa 16/4": base.with_(dim=1024, n_layers=2, n_heads=16, n_kv_heads=4),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, reference {a.reference}, "
          f"seq {a.seq_len} x batch {a.batch}, median of {a.reps} steps after {a.warmup}", flush=True)
    fmt = "{:<20}{:>9}{:>10}{:>10}{:>11}{:>9}{:>7}"
    print(fmt.format("size", "params", "ours ms", "ref ms", "ref/ours", "GFLOP/s", "MFU"))
    if a.masking:
        print("  (ref: block_causal, documents of %d tokens; ref/ours: its step time over causal's)" % a.doc_len)
    speeds = []
    for name, args in sizes.items():
        r = bench(args, a.reference, a.batch, a.reps, a.warmup, a.doc_len if a.masking else 0)
        speeds.append(r["ref_s"] / r["ours_s"])
        print(fmt.format(name, f"{r['params'] / 1e6:.2f}M", f"{r['ours_s'] * 1e3:.1f}", f"{r['ref_s'] * 1e3:.1f}",
                         f"{speeds[-1]:.3f}", f"{r['flops'] / 1e9:.1f}", f"{100 * r['mfu']:.1f}%"), flush=True)
    if a.masking:  # "speeds" are then block_causal's step time over causal's
        print(f"block_causal/causal step time: max {max(speeds):.3f} over {len(speeds)} sizes (1.0 = free)")
    else:
        print(f"model/reference speed: min {min(speeds):.3f} over {len(speeds)} sizes (higher is better)")


if __name__ == "__main__":
    main()
