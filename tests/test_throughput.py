"""Tokens/s and MFU between logging steps (runtime/throughput.py): time validation pauses is left out."""

from unittest import mock

from torchtitan_lite.runtime import throughput
from torchtitan_lite.runtime.throughput import Throughput


def test_the_window_leaves_out_paused_time_and_starts_again_at_each_lap():
    clock = iter([10.0, 11.0, 14.0, 16.0, 17.0, 19.0])  # start, a pause's begin and end, three laps
    with mock.patch.object(throughput.time, "perf_counter", lambda: next(clock)):
        # Replica groups: a group trains its share of each step (at the third lap, half of 3 steps' batches).
        shares = iter([None, None, 1.5])
        meter = Throughput(global_tokens=800, world_size=4, flops_per_token=1e6, peak_flops=1e9, start_step=10,
                           batches=lambda: next(shares))
        with meter.paused():
            pass
        window = meter.lap(12)
        assert (window.seconds, window.steps) == (3.0, 2)  # 6 s, 3 of them paused
        assert window.fields() == {"tps": 800 * 2 / 4 / 3.0, "mfu": 100 * (800 * 2 / 4 / 3.0) * 1e6 / 1e9}
        window = meter.lap(13)
        assert (window.seconds, window.steps) == (1.0, 1)  # from the previous lap on
        window = meter.lap(16)
        assert (window.seconds, window.steps, window.tps) == (2.0, 3, 800 * 1.5 / 4 / 2.0)
