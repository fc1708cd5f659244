"""Today's code reproduces the committed reference curve, so a numerics change shows up in CI.

tests/assets/losses/debugmodel_cpu.txt holds the debug model's loss for 50 steps on synthetic data in fp32 on one
CPU process (tests/assets/tiny.toml with flavor "debugmodel"). Tolerance 1e-4 absolute: on one machine the curve is
bitwise reproducible, and changing the layout (other reduction orders) moves it by < 1e-6 over 50 steps; a CPU with
other SIMD or BLAS kernels changes every matmul's reduction order, for which 100x that is ample. A real numerics
change (init, data order, schedule, loss normalization, a missed gradient reduction) moves the early steps by 1e-3 or
more.
Regenerate after an intended change: `python tests/multiprocess/test_reference_curve.py --update`.
A 2-stage pipeline (Interleaved1F1B) and context parallelism over 2 ranks reproduce the same reference, as every
layout must (both in one 2-process job, over its first LAYOUT_STEPS steps, without the decay that the 50-step
schedule only starts after them: the layouts' own reduction orders are what they add, and 20 steps show them as 50
do).
"""

import sys
import tempfile
from pathlib import Path

import pytest

import made_later
from launch import CP2, DEBUGMODEL, PP2, ROOT, losses, torchrun_several, train_in_process

REFERENCE = ROOT / "tests/assets/losses/debugmodel_cpu.txt"
STEPS, LAYOUT_STEPS, TOLERANCE = 50, 20, 1e-4


def current_curve(folder: Path) -> dict[int, float]:
    train_in_process(folder, *DEBUGMODEL, "--training.steps", str(STEPS))
    return losses(folder)


def read_reference() -> dict[int, float]:
    rows = [line.split() for line in REFERENCE.read_text().splitlines() if line and not line.startswith("#")]
    return {int(step): float(loss) for step, loss in rows}


def assert_reproduces(now: dict[int, float], steps: int = STEPS) -> None:
    ref = read_reference()
    assert sorted(ref) == list(range(1, STEPS + 1)) and sorted(now) == list(range(1, steps + 1))
    ref = {s: ref[s] for s in now}
    worst = max(abs(now[s] - ref[s]) for s in ref)
    assert worst <= TOLERANCE, f"loss curve moved by {worst:.2e} (step {max(ref, key=lambda s: abs(now[s] - ref[s]))})"


def test_reference_curve_is_reproduced(tmp_path):
    assert_reproduces(current_curve(tmp_path))


LAYOUTS = {"pipeline": (*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
           "context_parallel": CP2}


def train_the_layouts(root: Path) -> Path:
    torchrun_several(2, [(root / name, False, ("--training.steps", str(LAYOUT_STEPS),
                                                   "--lr_scheduler.decay_ratio", "0", *DEBUGMODEL, *overrides))
                         for name, overrides in LAYOUTS.items()])
    return root


made_later.register("reference_layouts", train_the_layouts)


@pytest.mark.reads("reference_layouts")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_reproduces_the_reference_curve(made, layout):
    assert_reproduces(losses(made("reference_layouts") / layout), LAYOUT_STEPS)


if __name__ == "__main__" and "--update" in sys.argv:
    with tempfile.TemporaryDirectory() as tmp:
        curve = current_curve(Path(tmp))
    header = "# step loss: debug model, synthetic data, fp32, 1 CPU process, tests/assets/tiny.toml, 50 steps\n"
    REFERENCE.write_text(header + "".join(f"{s} {curve[s]!r}\n" for s in sorted(curve)))
    print(f"wrote {REFERENCE}")
