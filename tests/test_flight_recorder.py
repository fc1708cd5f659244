"""flight_recorder.py in one process: the line a hang gets from the surviving ranks' posts, the posts pooled through
the witness store (ranks as threads), and torch's flight record of a real gloo collective written where the docs say."""

import os
import pickle
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from torchtitan_lite.runtime import errors, flight_recorder, signals
from tests.test_errors import StoppedStore
from torchtitan_lite.runtime.process import Env

pytestmark = pytest.mark.answers_within_fractions  # so it runs after the shared jobs (multiprocess/conftest.py)

ALL_GATHER = {"point": "the forward of block 1", "op": "all_gather", "seq": 30, "group": "dp_shard",
              "ranks": [0, 1, 2, 3]}


def test_the_line_names_the_silent_rank_the_collective_and_the_point():
    posts = {0: ALL_GATHER, 1: ALL_GATHER, 3: {**ALL_GATHER, "point": "the backward"}}
    assert flight_recorder.diagnosis(posts, 0, 4, "out/comm_traces") == (
        "; rank 2 did not join all_gather #30 of the dp_shard group (0-3), which rank 0 waited on in the forward of "
        "block 1; flight records of ranks 0, 1, 3 in out/comm_traces")


def test_only_the_silent_ranks_of_the_stalled_group_are_named():
    mine = {**ALL_GATHER, "group": "dp_shard", "ranks": [0, 2]}  # ranks 1 and 2 silent; rank 1 is in another group
    assert "; rank 2 did not join all_gather #30 of the dp_shard group (0, 2)," in \
        flight_recorder.diagnosis({0: mine, 3: mine}, 0, 4, "")


def test_a_pipeline_send_and_a_run_without_records_name_the_point_alone():
    said = flight_recorder.diagnosis({1: {"point": flight_recorder.P2P}}, 1, 2, "")
    assert said == "; rank 0 did not join a pipeline send/receive, which rank 1 waited on in a pipeline send/receive"
    said = flight_recorder.diagnosis({0: {"point": "a checkpoint save"}}, 0, 4, "")  # comm.trace_buf_size = 0
    assert said == "; ranks 1-3 did not join a collective, which rank 0 waited on in a checkpoint save"


def test_every_rank_posted_nothing_to_add():
    assert flight_recorder.diagnosis({0: ALL_GATHER, 1: ALL_GATHER}, 0, 2, "f") == ""


@pytest.fixture
def witness(monkeypatch):
    monkeypatch.setattr(errors.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(errors, "_STORE_ANSWER_S", 0.2)
    return lambda store: monkeypatch.setattr(errors, "_witness", lambda env: store)


def gather_on(ranks, wait_s):
    got = {}
    threads = [threading.Thread(target=lambda r=r: got.update({r: errors.gather(Env(r, r, 4, 4), "hang", f"post {r}",
                                                                                wait_s)})) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_gather_pools_the_posts_of_the_ranks_that_answer(witness):
    witness(dist.HashStore())
    got = gather_on([0, 1, 3], wait_s=0.5)  # rank 2 is stopped: every survivor waits the bound, then goes on
    assert got == {r: {0: "post 0", 1: "post 1", 3: "post 3"} for r in (0, 1, 3)}
    witness(dist.HashStore())
    start = time.monotonic()
    assert gather_on([0, 1, 2, 3], wait_s=30)[2] == {r: f"post {r}" for r in range(4)}
    assert time.monotonic() - start < 10  # every rank posted: nobody waits the bound


def test_a_rank_the_launcher_stops_while_it_waits_waits_moments_more(witness):
    """A worker that died makes torchrun stop every other at once (SIGTERM, here after 0.3 s): their posts come within
    moments and the dead rank's never, so a survivor stops waiting soon after, not at the end of the gather (30 s)."""
    witness(dist.HashStore())
    preemption = signals.Preemption(None)
    timer = threading.Timer(0.3, lambda: setattr(preemption, "received", signal.SIGTERM))  # as its handler does
    try:
        timer.start()
        start = time.monotonic()
        got = errors.gather(Env(0, 0, 4, 4), "hang", "post 0", 30)
        waited = time.monotonic() - start
    finally:
        timer.cancel()
        signals.restore_signals()
    assert got == {0: "post 0"}
    assert 0.3 + errors._AFTER_STOP_S <= waited < 10, waited


def test_gather_through_a_stopped_witness_returns_this_ranks_post(witness):
    witness(StoppedStore())
    assert gather_on([0], wait_s=30) == {0: {0: "post 0"}}


def test_the_folder_nccl_dumps_into_exists_once_recording_is_on(tmp_path, monkeypatch):
    """NCCL's watchdog writes its record to TORCH_FR_DUMP_TEMP_FILE + rank on a timeout and creates no folder: enable
    makes it before any collective can time out; with recording off, nothing is made."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)  # restored after the test: enable() sets them
    flight_recorder.enable(0, str(tmp_path / "off"))
    assert not (tmp_path / "off").exists() and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    try:
        flight_recorder.enable(100, str(tmp_path / "run"))
        prefix = os.environ["TORCH_FR_DUMP_TEMP_FILE"]
        assert prefix == str(tmp_path / "run" / "comm_traces" / "rank_") and os.path.isdir(os.path.dirname(prefix))
    finally:
        flight_recorder.enable(0, str(tmp_path))  # no recording for later in-process runs


def test_a_gloo_collective_is_recorded_and_written_for_torchs_analyzer(tmp_path, monkeypatch):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.setenv(name, "")  # restored after the test: enable() sets them
    flight_recorder.enable(100, str(tmp_path))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        dist.all_reduce(torch.ones(2))
        last = flight_recorder._last_collective()
    finally:
        dist.destroy_process_group()
        flight_recorder.enable(0, str(tmp_path))  # leaves no folder behind for later in-process runs
    assert last == {"op": "all_reduce", "seq": last["seq"], "group": "world", "ranks": [0]} and last["seq"] >= 1
    trace = pickle.loads((tmp_path / "comm_traces" / "rank_0").read_bytes())
    assert trace["entries"][-1]["profiling_name"] == "gloo:all_reduce"
    assert {c["ranks"] for c in trace["pg_config"].values()} == {"[0]"}


def test_blocks_name_their_forward_and_backward(monkeypatch):
    points = []
    monkeypatch.setattr(flight_recorder, "at", points.append)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2), "1": torch.nn.Linear(2, 2)})
    flight_recorder.mark_blocks([model])
    model.layers["1"](model.layers["0"](torch.ones(1, 2))).sum().backward()
    assert points == ["the forward of block 0", "the forward of block 1", "the backward of block 1",
                      "the backward of block 0"]
    with torch.no_grad():  # validation: no gradient, no hook on its output
        model.layers["0"](torch.ones(1, 2))
    assert points[-1] == "the forward of block 0"
