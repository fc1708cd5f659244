"""A phase named once (runtime/phases.py) sets the point a hang names, where its table gives one; the ranges it opens
in traces are tests/test_profiling.py's."""

import pytest
import torch

from torchtitan_lite.config import load_config
from torchtitan_lite.runtime import flight_recorder, phases
from torchtitan_lite.runtime.profiling import StepProfiler


@pytest.fixture
def phase(tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(flight_recorder, "at", said.append)  # as tests/multiprocess/stop_at.py stops a rank
    profiler = StepProfiler(load_config([]).profiling, str(tmp_path), 0, torch.device("cpu"), 0)
    return phases.Phases(profiler), said


def test_each_phase_sets_the_point_its_table_entry_names(phase):
    phase, said = phase
    for name in phases.POINTS:
        with phase(name):
            pass
    assert said == [point for point in phases.POINTS.values() if point]  # the others leave it to code deeper in


def test_an_unnamed_phase_is_refused(phase):
    with pytest.raises(KeyError):
        phase[0]("no such phase")
