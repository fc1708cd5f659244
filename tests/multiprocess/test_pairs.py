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
from conftest import PAIR_RUNS, SHARED_RUNS
from launch import read_metrics

FP32_TOLERANCE = 1e-5  # as the layouts' (test_layouts.py): only the order of float32 reductions differs
# Half precision: FSDP casts the parameters themselves to the compute dtype (every op runs in it), while one process
# autocasts matmuls only, so the layouts differ from the reference by more than reduction order: the loss by about
# one unit in the last place of an 8-bit (bf16) or 11-bit (fp16) mantissa at loss ~6, the grad norm relatively by
# about the same. Measured gaps (worst row): see HALF_TOLERANCE's comment.
HALF_TOLERANCE = {"bfloat16": 0.05, "float16": 0.01}


def covered(runs: dict) -> set:
    return set().union(*(pairs.pairs_of(pairs.levels_of(nproc, overrides)) for nproc, overrides in runs.values()))


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
    for nproc, overrides in PAIR_RUNS.values():
        assert pairs.allowed(pairs.levels_of(nproc, overrides))


@pytest.mark.parametrize("pair", list(pairs.REFUSED))
def test_a_refused_pair_is_one_line_from_check(pair, error_line):
    nproc, overrides, expected = pairs.REFUSED[pair]
    assert expected in error_line(nproc, list(overrides))


@pytest.mark.parametrize("name", list(PAIR_RUNS))
def test_generated_row_matches_the_single_process_run_of_its_precision(runs, name):
    precision = pairs.levels_of(*PAIR_RUNS[name])["precision"]
    ref = {m["step"]: m for m in read_metrics(runs["single" if precision == "float32" else f"single_{precision}"])}
    got = read_metrics(runs[name])
    assert [m["step"] for m in got] == list(range(1, pairs.STEPS[precision] + 1))
    tolerance = FP32_TOLERANCE if precision == "float32" else HALF_TOLERANCE[precision]
    for m in got:
        r = ref[m["step"]]
        assert abs(m["loss"] - r["loss"]) <= tolerance, (m["step"], m["loss"], r["loss"])
        same_norm = (m["grad_norm"] == r["grad_norm"] if not math.isfinite(r["grad_norm"])
                     else abs(m["grad_norm"] - r["grad_norm"]) <= tolerance * r["grad_norm"])
        assert same_norm, (m["step"], m["grad_norm"], r["grad_norm"])
