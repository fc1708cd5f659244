import pytest

from torchtitan_lite.runtime import process as distributed
from torchtitan_lite.runtime.process import Env, job_store, peer_timeout


@pytest.mark.parametrize("gloo, cause", [
    ("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation",
     "Timed out waiting 3000ms for recv operation"),
    # the same timeout, met on a connection to the peer
    ("Application timeout caused pair closure", "Application timeout caused pair closure"),
    # in a group of more than two: a peer that timed out first closed its connections (gloo's advice left out)
    ("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:16605. This is typically caused by a "
     "remote worker crashing. Check the logs", "Connection closed by peer [127.0.0.1]:16605"),
    # a peer that died: the system reset its connections
    ("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:2981: Connection reset by peer. This is typically "
     "caused by a remote worker hanging", "Connection reset by peer"),
])
def test_gloo_timeouts_become_one_line_naming_the_bound(gloo, cause, monkeypatch):
    monkeypatch.setattr(distributed, "_timeout", "comm.train_timeout_seconds = 3")  # as set_timeout(3) leaves it
    error = str(peer_timeout(RuntimeError(f"some context\n{gloo}\nmore")))
    assert error == ("a collective waited longer than comm.train_timeout_seconds = 3 s: a peer rank is hung, stopped "
                     f"or dead (gloo: {cause})")


def test_a_pipeline_stages_error_is_read_through_its_cause():
    # torch.distributed.pipelining raises "[Stage 1] failed to run forward" from gloo's error
    try:
        try:
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:16605")
        except RuntimeError as gloo:
            raise RuntimeError("\n[Stage 1] failed to run forward:\nargs: ('Tensor(...)',)") from gloo
    except RuntimeError as stage:
        assert "(gloo: Connection closed by peer [127.0.0.1]:16605)" in str(peer_timeout(stage))


def test_other_errors_are_not_timeouts():
    assert peer_timeout(RuntimeError("Connection refused")) is None


def test_a_single_process_has_no_job_store():
    assert job_store(Env(0, 0, 1, 1)) is None
