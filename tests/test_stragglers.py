"""The slowest rank against the median one (runtime/stragglers.py); the real gather and warning run in
tests/multiprocess/test_profiling.py with one rank's data slowed."""

from torchtitan_lite.runtime.stragglers import slowest


def test_a_slow_data_wait_names_its_rank_though_step_times_are_even():
    rank, lag, fields = slowest([0.50, 0.50, 0.51, 0.50], [0.01, 0.30, 0.01, 0.02])
    assert (rank, fields["slowest_data_loading_s"], fields["median_data_loading_s"]) == (1, 0.30, 0.015)
    assert abs(lag - 0.285) < 1e-12


def test_a_slow_step_names_its_rank():
    rank, lag, fields = slowest([0.5, 0.5, 0.9], [0.0, 0.0, 0.0])
    assert (rank, fields["slowest_step_s"], fields["median_step_s"]) == (2, 0.9, 0.5)
    assert abs(lag - 0.4) < 1e-12
