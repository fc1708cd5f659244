"""Bad input fails fast on every rank: one error line from rank 0 naming the key, a non-zero exit, no hung rank."""

import time

import pytest

from launch import torchrun

CASES = {  # processes, overrides, what the error line must name
    "tp_not_dividing_world": (4, ["--parallelism.tensor_parallel_degree", "3"], "tensor_parallel_degree 3"),
    "heads_not_divisible_by_tp": (3, ["--parallelism.tensor_parallel_degree", "3"], "n_heads = 16"),
    "unknown_key": (4, ["--training.stepz", "3"], "training.stepz"),
    "wrong_type": (4, ["--training.steps", "abc"], "training.steps"),
    "global_batch_not_a_multiple": (4, ["--training.global_batch_size", "6"], "training.global_batch_size"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_clear_error(tmp_path, case):
    nproc, overrides, expected = CASES[case]
    start = time.monotonic()
    proc = torchrun(nproc, tmp_path / "out", *overrides, timeout=120, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    errors = [line for line in output.splitlines() if "error: " in line and expected in line]
    assert len(errors) == 1, output[-3000:]
    assert time.monotonic() - start < 90
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
