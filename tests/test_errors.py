"""errors.report once the process group exists, in one process: the ranks are threads sharing the witness store."""

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from torchtitan_lite.runtime import errors
from torchtitan_lite.runtime.process import Env

pytestmark = pytest.mark.answers_within_fractions  # so it runs after the shared jobs (multiprocess/conftest.py)


class StoppedStore:
    """A client of a store whose server is stopped (SIGSTOP): no request ever returns."""

    def __init__(self):
        self._never = threading.Event()

    def _hang(self, *args):
        self._never.wait(60)  # a bound only so that a regression fails instead of hanging the suite
        raise RuntimeError("no answer")

    check = compare_set = set = _hang


@pytest.fixture
def after_group(monkeypatch):
    """report() as after the group exists, rank 0 given 0.2 s to speak, lines on stderr; returns a setter of the
    witness store."""
    monkeypatch.setattr(errors.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(errors, "train_timeout", lambda: timedelta(seconds=0.2))
    monkeypatch.setattr(errors, "_STORE_ANSWER_S", 0.2)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    return lambda store: monkeypatch.setattr(errors, "_witness", lambda env: store)


def report_on(ranks, error="a peer rank is hung"):
    threads = [threading.Thread(target=errors.report, args=(RuntimeError(error), Env(r, r, 4, 4))) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def error_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


def test_surviving_ranks_say_one_line_for_a_silent_rank_0(after_group, capsys):
    after_group(dist.HashStore())
    report_on([1, 2, 3])  # rank 0 is stopped: it never reports
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].endswith(": a peer rank is hung") and lines[0].startswith("error: rank "), lines


def test_rank_0_speaks_for_the_job_and_the_others_stay_silent(after_group, capsys):
    after_group(dist.HashStore())
    report_on([0, 1, 2, 3])
    assert error_lines(capsys) == ["error: a peer rank is hung"]


def test_a_stopped_witness_holds_no_rank_and_leaves_rank_0_to_speak(after_group, capsys):
    after_group(StoppedStore())  # the store's server, rank 1, is the stopped rank
    report_on([0, 2, 3])
    assert error_lines(capsys) == ["error: a peer rank is hung"]


class WatchedStore(dist.HashStore):
    """A witness that records every call made to it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def check(self, keys):
        self.calls.append("check")
        return super().check(keys)

    def compare_set(self, key, expected, desired):
        self.calls.append("compare_set")
        return super().compare_set(key, expected, desired)


def test_ranks_that_torchrun_stops_leave_the_line_to_rank_0_who_skips_the_witness(after_group, capsys, monkeypatch):
    """A worker died, and torchrun stops the others (SIGTERM) while they wait for rank 0's line: rank 0 may be waiting
    on one of them (a pipeline's receive), so they leave at once, silent (torchrun's summary names the dead rank), and
    rank 0 speaks without the witness, whose server may have left with rank 1."""
    monkeypatch.setattr(errors.signals, "stop_requested", lambda: True)
    after_group(store := WatchedStore())
    report_on([1, 2, 3])
    assert error_lines(capsys) == [] and "compare_set" not in store.calls  # no election: nobody spoke
    store.calls.clear()
    report_on([0])
    assert error_lines(capsys) == ["error: a peer rank is hung"] and store.calls == []


class GoneAfterPosting(dist.HashStore):
    """A witness whose server leaves (with rank 1) once this rank has posted."""

    def check(self, keys):
        raise RuntimeError("Connection reset by peer")


def test_gather_keeps_this_ranks_own_post_when_the_witness_leaves(after_group):
    # or the line names this rank among those that did not join, and its flight record as no one's
    after_group(GoneAfterPosting())
    assert errors.gather(Env(0, 0, 1, 1), "hang", "mine", 0.2) == {0: "mine"}
