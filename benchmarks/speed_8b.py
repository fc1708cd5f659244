"""The model code's speed on one GPU at Llama 3 8B's shapes, for benchmarks/gpu_paths.py's step8b and float8_8b:
a few 8B blocks with the 128k vocabulary, trained as train.py's step trains them, and one FFN linear alone.
"""

from __future__ import annotations

import time

import torch

from torchtitan_lite.config import load_config
from torchtitan_lite.models.registry import get
from torchtitan_lite.quantization import float8
from torchtitan_lite.runtime.metrics import peak_flops

LLAMA3 = get("llama3")


def blocks8b(compiled: bool, float8_args: tuple[str, ...] = (), n_layers: int = 2) -> dict:
    """Tokens/s, MFU and peak memory of 8B blocks (seq 8192, batch 1, bf16 autocast, fused AdamW)."""
    args = LLAMA3.args("8B", 128256, 8192).with_(n_layers=n_layers)
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LLAMA3.model_class(args)
    if float8_args:
        float8.convert(model, load_config(["--float8.enable_float8_linear", *float8_args]), fsdp=False)
    model.to_empty(device=device)
    model.init_weights()
    if compiled:
        for block in model.layers.values():
            block.compile(fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, args.vocab_size, (1, 8193), device=device)
    times = []
    for i in range(11):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    token_flops = LLAMA3.flops_per_token(model, 8192)
    tps = 8192 / sorted(times)[len(times) // 2]
    mfu = 100 * tps * token_flops / peak_flops(device, torch.bfloat16)
    out = {"tokens/s": round(tps), "MFU % (bf16 peak)": round(mfu, 1),
           "peak GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2), "loss at 11": round(loss.item(), 4)}
    del model, opt, logits, loss
    return out


def float8_linear_ms() -> dict:
    """The matmul speed-up alone, at the 8B FFN's shape, each compiled: milliseconds per forward + backward."""
    out = {}
    for recipe in (None, "tensorwise", "rowwise"):
        torch.manual_seed(0)
        layer = torch.nn.Sequential(torch.nn.Linear(4096, 14336, bias=False, device="cuda", dtype=torch.bfloat16))
        if recipe:
            float8.convert(layer, load_config(["--float8.enable_float8_linear", "--float8.recipe_name", recipe]),
                           fsdp=False)
        step = torch.compile(lambda x, layer=layer: layer(x).sum().backward())
        x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3):
            step(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            step(x)
        end.record()
        torch.cuda.synchronize()
        out[recipe or "bf16"] = round(start.elapsed_time(end) / 20, 3)
    return out
