"""Compiled float8 blocks against eager ones: how far inductor's step-1 gradients are from eager's, next to how far
eager's own move when every weight changes by one ulp (float8's sensitivity to fp32 rounding).

    python benchmarks/float8_compile.py [--backend inductor] [--threads 2]

One step of the debug model (tests/assets/tiny.toml: 2 x 64 tokens, fp32) through the trainer's step (step.Step),
its linears converted to torchao's emulated Float8Linear as train.py converts them and its blocks compiled in place
as parallelize() compiles them. aot_eager reruns eager's kernels, so its gradients are eager's bit for bit (the suite
checks it: tests/test_float8_runs.py); inductor fuses the fp32 ops around the matmuls (norms, rotary, SiLU) with
another rounding. float8 (3 mantissa bits) turns an ulp's difference there into a different rounding of some
elements, which moves the gradients by a share that the perturbation below measures. Per parameter: the largest
difference over its reference's largest element, and the SQNR (20 log10 |reference| / |difference|).

Prints the compile time, each comparison's worst parameter, and last `float8 <backend>/eager gradients: worst W
(SQNR >= S dB); one ulp of the weights: worst W' (SQNR >= S' dB)`.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from torchtitan_lite.config import load_config
from torchtitan_lite.models import registry
from torchtitan_lite.quantization import float8
from torchtitan_lite.tools.memory import model_args
from torchtitan_lite.training.step import Numerics, Step

TINY = Path(__file__).resolve().parents[1] / "tests" / "assets" / "tiny.toml"
FP32 = Numerics(torch.float32, autocast=False, loss_parallel=False)


def step_grads(f8: bool, backend: str | None = None, ulps: int = 0) -> dict[str, torch.Tensor]:
    """Every parameter's gradient after one step from the tests' initial weights, each weight moved by `ulps` ulps
    up or down (a fixed random sign per element)."""
    cfg = load_config(["--job.config_file", str(TINY), "--model.flavor", "debugmodel", "--float8.enable_float8_linear",
                       "--float8.emulate"])
    model = registry.get(cfg.model.name).model_class(model_args(cfg)[0])
    model.init_weights(seed=cfg.training.seed)
    if f8:
        float8.convert(model, cfg, fsdp=False)
    signs = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + ulps * 2.0**-23 * torch.randint(0, 2, p.shape, generator=signs).mul(2).sub(1))
    if backend:
        for block in model.layers.values():
            block.compile(backend=backend, fullgraph=True)
    tokens = torch.randint(0, model.args.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    Step(model, torch.device("cpu"), FP32).train_step([(tokens[:, :-1], tokens[:, 1:])], tokens[:, 1:].numel())
    return {name: p.grad for name, p in model.named_parameters()}


def compare(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, float, str]:
    """(the worst relative difference, the lowest SQNR in dB, the parameter with the worst difference)."""
    worst, sqnr = {}, {}
    for name, ref in reference.items():
        diff = got[name] - ref
        worst[name] = (diff.abs().max() / ref.abs().max()).item()
        sqnr[name] = math.inf if diff.norm() == 0 else 20 * math.log10(ref.norm() / diff.norm())
    name = max(worst, key=worst.get)
    return worst[name], min(sqnr.values()), name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled blocks")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    eager = step_grads(True)
    start = time.perf_counter()
    compiled = step_grads(True, args.backend)
    print(f"{args.backend}: compiled and stepped in {time.perf_counter() - start:.0f}s")
    rows = {f"float8 {args.backend}/eager": compare(compiled, eager),
            "float8, one ulp of the weights": compare(step_grads(True, ulps=1), eager),
            "fp32, one ulp of the weights": compare(step_grads(False, ulps=1), step_grads(False))}
    for label, (worst, sqnr, name) in rows.items():
        print(f"{label:<32} worst {worst:.2e} ({name}), SQNR >= {sqnr:.1f} dB")
    (w, s, _), (w1, s1, _) = rows[f"float8 {args.backend}/eager"], rows["float8, one ulp of the weights"]
    print(f"float8 {args.backend}/eager gradients: worst {w:.2e} (SQNR >= {s:.1f} dB); "
          f"one ulp of the weights: worst {w1:.2e} (SQNR >= {s1:.1f} dB)")


if __name__ == "__main__":
    main()
