"""Every FSDP2 option leaves the loss curve where it was: the same 4-process FSDP run with them on agrees with the
shared run without them to 1e-5 (the gradient reduce's summation order may move the last bits). That each option
reaches fully_shard is checked in tests/test_parallelize.py.

Two runs carry all the options (shared runs, run_table.py): each option changes when or where a tensor lives, not
what is computed, so one that broke the numerics would show in its run's curve.
"""

import pytest

from launch import assert_same_curve, losses

TOLERANCE = 1e-5


@pytest.mark.parametrize("name", ["fsdp4_hpz_prefetch_deferred_reduce", "fsdp4_offload_reshard_always"])
def test_fsdp_option_leaves_the_curve_unchanged(runs, name):
    assert sorted(losses(runs[name])) == list(range(1, 5))
    assert_same_curve(runs[name], runs["fsdp4"], TOLERANCE)
