"""runtime/fence.py and what it gates, without processes: a replica group's claim on the folder, a stale writer
finding it taken (its records, saves and sweeps stand down), and a new writer logging what the one before it
committed and never logged (metric_logger.py)."""

import json
import logging

import pytest

from torchtitan_lite.checkpoint.folder import complete_checkpoints
from torchtitan_lite.checkpoint.trash import Trash, finish_publishing
from torchtitan_lite.runtime.fence import Fence, file_state
from torchtitan_lite.runtime.metric_logger import MetricLogger, last_step
from torchtitan_lite.runtime.run_history import read_history


def start(folder) -> None:
    (folder / "metrics.jsonl").write_text(json.dumps({"event": "start", "run": "r", "step": 0}) + "\n")


def test_a_claim_holds_until_another_group_claims_and_a_stale_writer_says_so_once(tmp_path, caplog):
    start(tmp_path)
    first, second = Fence(str(tmp_path)), Fence(str(tmp_path))
    assert not first.holds()  # never claimed
    assert first.claim(1, "g0q1", {"writer": 0, "trained": [0, 1]}) is None
    assert first.holds() and first.holds()
    with open(tmp_path / "metrics.jsonl", "a") as f:  # records appended since: read once, not again
        f.write('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n')
    assert first.holds()
    assert second.claim(3, "g1q2", {"writer": 1, "trained": [1], "left": [0]}) == "g0q1"
    assert not first.holds() and second.holds()
    with caplog.at_level(logging.WARNING, "torchtitan_lite"):
        first.stand_down(0)
        first.stand_down(0)
    assert caplog.messages == ["replica group 0 stands down as the run's writer: group 1 took over at step 3 while "
                               "this one was stopped; it writes no record or checkpoint until it writes for the run "
                               "again"]
    assert last_step(str(tmp_path / "metrics.jsonl")) == 2  # a claim is not a step's record
    assert read_history(tmp_path)[0] == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9}]


def test_a_new_writer_logs_the_records_the_one_before_it_committed_and_never_logged(tmp_path, caplog):
    """Two groups' loggers: group 0 writes steps 1 and 2, then is stopped before it logs step 3; group 1, which made
    every record too, claims the folder at step 4 and writes 3 and 4. Group 0 wakes and writes nothing."""
    start(tmp_path)
    fences = [Fence(str(tmp_path)), Fence(str(tmp_path))]
    writer = [0]
    loggers = [MetricLogger(str(tmp_path), 0, 1, False, "tb", writes=lambda g=g: writer[0] == g and
                            fences[g].holds()) for g in (0, 1)]
    fences[0].claim(1, "g0q1", {"writer": 0})
    for step in (1, 2):
        for g in (1, 0):  # the writer last: group 1 drops what the file holds by its next record
            loggers[g].log(step, {"loss": 3.0 - step})
    loggers[1].log(3, {"loss": 0.0})
    writer[0] = 1
    fences[1].claim(4, "g1q2", {"writer": 1, "left": [0]})
    with caplog.at_level(logging.WARNING, "torchtitan_lite"):
        loggers[1].log(4, {"loss": -1.0})
        loggers[0].log(3, {"loss": 0.0})  # woken: the file holds step 3 already
    assert [r["step"] for r in read_history(tmp_path)[0]] == [1, 2, 3, 4]
    assert "metrics.jsonl: the records of steps 3 written by this job" in caplog.text
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line).get("token") for line in lines if "groups" in line] == ["g0q1", "g1q2"]


def test_a_tagged_sweep_touches_only_its_own_saves_in_progress(tmp_path):
    """A stale writer's sweep (tag g0q1) leaves the live writer's save in progress (g1q2), and publishes only its own
    complete one; a plain run's sweep (no tag) takes every leftover."""
    for name in ("step-4.g0q1.tmp", "step-6.g1q2.tmp", "step-2.g0q1.tmp", "step-8.tmp"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-2.g0q1.tmp" / ".metadata").write_text("")  # complete, never published
    (tmp_path / "step-6.g1q2.tmp" / ".metadata").write_text("")
    trash = Trash()
    trash.sweep(str(tmp_path), "g0q1")
    trash.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-6.g1q2.tmp", "step-8.tmp"]
    assert sorted(complete_checkpoints(str(tmp_path))) == [2, 6]
    trash.discard_tagged(str(tmp_path), "g1q2")  # a new writer takes over from g1q2: its save will not be published
    finish_publishing(str(tmp_path), trash)
    trash.sweep(str(tmp_path))
    trash.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]


def test_a_restarted_group_is_behind_the_run_only_when_no_group_is_alive_to_heal_from(tmp_path, monkeypatch):
    """Replicas._alone_check on a restarted group whose checkpoint (step 4) is older than what the others logged
    since it started: alone, it stops; beside live groups (its first heal failed: the sender died), it asks again
    and heals from another (it stopped here before, the file's time being all it looked at)."""
    import torch.distributed as dist

    from torchtitan_lite.config import ConfigError
    from torchtitan_lite.training import replicas
    from torchtitan_lite.training.replicas import Replicas

    start(tmp_path)
    found = file_state(str(tmp_path))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.0}\n')
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: None)  # one rank: its answer is the group's
    monkeypatch.setattr(replicas, "restarts", lambda: 1)
    group = object.__new__(Replicas)
    group.folder, group._at_start, group.group_rank, group.resumable = str(tmp_path), found, 0, True
    group._history, group.train_state = lambda: None, type("State", (), {"step": 4})()
    group.cfg, group.preemption = type("Cfg", (), {"replica_id": 1})(), type("P", (), {"group": None})()
    group.live = 2
    group._alone_check()
    group.live = 1
    with pytest.raises(ConfigError, match="replica group 1 is behind the run: another group logged steps past 4"):
        group._alone_check()


def test_a_claim_is_lost_when_another_group_begins_the_history_anew(tmp_path, caplog):
    """The file replaced (another group's start_history) since the claim: no claim of this group's is in it."""
    start(tmp_path)
    fence = Fence(str(tmp_path))
    fence.claim(1, "g0q1", {"writer": 0})
    (tmp_path / "new").write_text(json.dumps({"event": "start", "run": "s", "step": 0}) + "\n")
    (tmp_path / "new").replace(tmp_path / "metrics.jsonl")
    assert not fence.holds()
    with caplog.at_level(logging.WARNING, "torchtitan_lite"):
        fence.stand_down(0)
    assert caplog.messages == ["replica group 0 stands down as the run's writer: another group began the run's "
                               "history anew while this one was stopped; it writes no record or checkpoint until it "
                               "writes for the run again"]
