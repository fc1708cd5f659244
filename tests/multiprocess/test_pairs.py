"""Every pair of options that changes how a step computes is run or refused (pairs.py: the factors, their
constraints and the generator of the rows the shared runs lack).

The covering property is checked in this process from the runs' command lines, read as the trainer reads them: every
applicable pair that --check does not refuse is held by a shared run or a generated row, so a new level without a
run fails here. Each generated row then trains on its layout and gives the single-process curve of its precision:
loss and grad norm at every step.
"""

import math

import pytest

import pairs
from run_table import PAIR_RUNS, SHARED_RUNS
from launch import read_metrics

pytestmark = pytest.mark.reads("shared_2p", "shared_8p")

# Loss and grad norm (relative) of a row against the single-process run of its precision, by the row's precision or
# reduce dtype, whichever is looser. float32: only the order of reductions differs (as test_layouts.py's layouts).
# Half precision: FSDP casts the parameters themselves to the compute dtype, so every op runs in it, while one process
# autocasts the matmuls only; a bf16 reduce rounds each gradient to bf16 before the sum. The loss gap at step 2 is the
# step-1 update's rounding, so it grows with how far that update moves the loss. The worst gaps measured over the
# generated rows' 2 steps: bf16 loss 2.2e-3 (at step 2, after an update that moves the loss by 0.2; on the synthetic
# data before it, which drew special ids too, that update moved it by 0.02, and two rows rerun on it gave at most
# 4.8e-4), grad norm 3.7e-4; fp16 loss 1.5e-4, grad norm 3.2e-4; fp32 with a bf16 reduce, loss 4.3e-6, grad norm
# 2.3e-5. The bounds are bf16's and fp16's unit roundoff (2**-8 = 3.9e-3, 2**-11 = 4.9e-4; fp16's doubled): a
# gradient reduced twice or not at all moves the norm by far more.
TOLERANCE = {"float32": 1e-5, "bfloat16": 4e-3, "float16": 1e-3}
# A float8 row against the float8 run of its recipe and precision: float8's own drift (test_float8.py says why a
# layout's ulps become float8 roundings).
FLOAT8 = 1e-3

def covered(runs: dict) -> set:
    return set().union(*(pairs.pairs_of(pairs.levels_of(run.nproc, run.argv)) for run in runs.values()))


def test_every_applicable_pair_is_run_by_a_shared_run_or_a_generated_row():
    missing = pairs.applicable_pairs() - covered({**SHARED_RUNS, **PAIR_RUNS})
    assert not missing, f"{len(missing)} pairs run nowhere, e.g. {sorted(missing)[:5]}"


def test_a_new_level_without_a_run_is_uncovered(monkeypatch):
    monkeypatch.setitem(pairs.FACTORS, "ac", (*pairs.FACTORS["ac"], "selective_3"))
    missing = pairs.applicable_pairs() - covered({**SHARED_RUNS, **PAIR_RUNS})
    assert missing and all(("ac", "selective_3") in pair for pair in missing)


def test_every_excluded_pair_says_why_and_none_for_the_tests_budget():
    every = sum(len(pairs.FACTORS[f]) * len(pairs.FACTORS[g]) for i, f in enumerate(pairs.FACTORS)
                for g in list(pairs.FACTORS)[i + 1:])
    excluded = pairs.excluded_pairs()
    assert len(pairs.applicable_pairs()) + len(excluded) == every
    assert not [p for p, why in excluded.items() if why.startswith("beyond")], excluded


def test_generated_rows_hold_the_levels_they_were_made_for():
    # Each row's command line reads back as a row no constraint forbids: no ignored option, no impossible layout.
    for run in PAIR_RUNS.values():
        assert pairs.allowed(pairs.levels_of(run.nproc, run.argv))


@pytest.mark.parametrize("pair", list(pairs.REFUSED))
def test_a_refused_pair_is_one_line_from_check(pair, error_line):
    nproc, overrides, expected = pairs.REFUSED[pair]
    assert expected in error_line(nproc, list(overrides))


@pytest.mark.parametrize("name", list(PAIR_RUNS))
def test_generated_row_matches_the_single_process_run_of_its_precision(runs, name):
    run = PAIR_RUNS[name]
    levels = pairs.levels_of(run.nproc, run.argv)
    precision = levels["precision"]
    ref = {m["step"]: m for m in read_metrics(runs[run.reference])}
    got = read_metrics(runs[name])
    assert [m["step"] for m in got] == list(range(1, pairs.STEPS[precision] + 1))
    tolerance = max(TOLERANCE[precision], TOLERANCE[levels["reduce"]], FLOAT8 if levels["float8"] != "off" else 0)
    for m in got:
        r = ref[m["step"]]
        assert abs(m["loss"] - r["loss"]) <= tolerance, (m["step"], m["loss"], r["loss"])
        same_norm = (m["grad_norm"] == r["grad_norm"] if not math.isfinite(r["grad_norm"])
                     else abs(m["grad_norm"] - r["grad_norm"]) <= tolerance * r["grad_norm"])
        assert same_norm, (m["step"], m["grad_norm"], r["grad_norm"])
