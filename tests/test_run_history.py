"""torchtitan_lite/runtime/run_history.py: one dump folder, one run's history. Reading metrics.jsonl (resume records, spliced
runs refused), a resume cutting the records past its checkpoint, a fresh start moving an earlier run aside, and the
trainer doing so when a run is rerun in its own folder."""

import json
import logging
import os

import pytest

from tests.multiprocess.launch import read_metrics, train_in_process
from torchtitan_lite.runtime.run_history import HistoryError, read_history, start_history


def write(path, *records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def steps(n, m, loss=1.0):
    return [{"step": s, "loss": loss + s} for s in range(n, m + 1)]


def test_a_resume_record_lets_steps_go_back_and_the_later_record_wins(tmp_path):
    # Logged 1-4, resumed from step 2's checkpoint, logged 3-5 again: a file joined by hand, not cut back.
    path = write(tmp_path / "m.jsonl", *steps(1, 4), {"event": "resume", "step": 2, "world_size": 2},
                 *steps(3, 5, loss=10.0), {"event": "other", "step": 1})
    records, resumes = read_history(path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 2.0), (2, 3.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    assert resumes == [{"event": "resume", "step": 2, "world_size": 2}]
    assert read_metrics(tmp_path / "m.jsonl") == records  # the tests' reader is the library's, events skipped


@pytest.mark.parametrize("records", [[*steps(1, 5), *steps(1, 2)], [*steps(1, 3), *steps(3, 4)]],
                         ids=["rerun", "repeated"])
def test_a_step_going_back_without_a_resume_record_is_refused(tmp_path, records):
    path = write(tmp_path / "m.jsonl", *records)
    with pytest.raises(HistoryError, match=r"m.jsonl:\d: step \d after step \d with no resume record between"):
        read_history(path)


def test_a_resume_cuts_the_records_past_its_step_and_marks_the_seam(tmp_path):
    metrics = write(tmp_path / "metrics.jsonl", *steps(1, 6))
    with open(metrics, "a") as f:
        f.write('{"step": 7, "lo')  # torn by the crash
    (tmp_path / "config.toml").write_text("steps = 6\n")
    start_history(str(tmp_path), 4, "steps = 6\n", "tb", world_size=2)
    records, resumes = read_history(metrics)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert resumes == [{"event": "resume", "step": 4, "world_size": 2}]  # the same config: none kept aside
    assert sorted(os.listdir(tmp_path)) == ["config.toml", "metrics.jsonl"]  # no temporary file left


def test_a_resume_under_another_config_keeps_the_earlier_one(tmp_path):
    (tmp_path / "config.toml").write_text("steps = 6\n")
    start_history(str(tmp_path), 4, "steps = 8\n", "tb", world_size=1)
    (tmp_path / "config.toml").write_text("steps = 10\n")  # a hand edit: resumed at 4 again, from another config
    start_history(str(tmp_path), 4, "steps = 12\n", "tb", world_size=1)
    assert (tmp_path / "config.toml").read_text() == "steps = 12\n"
    assert (tmp_path / "config.step-4.toml").read_text() == "steps = 6\n"
    assert (tmp_path / "config.step-4.2.toml").read_text() == "steps = 10\n"
    assert [r["earlier_config"] for r in read_history(tmp_path)[1]] == ["config.step-4.toml", "config.step-4.2.toml"]


def test_a_crash_while_cutting_leaves_the_file_whole(tmp_path, monkeypatch):
    metrics = write(tmp_path / "metrics.jsonl", *steps(1, 6))
    before = open(metrics).read()
    def killed(*args):
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(OSError):
        start_history(str(tmp_path), 4, "", "tb", world_size=1)
    assert open(metrics).read() == before


def test_a_fresh_start_moves_the_earlier_run_aside_under_the_next_free_number(tmp_path, caplog):
    write(tmp_path / "metrics.jsonl", *steps(1, 5))
    (tmp_path / "config.toml").write_text("first\n")
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1").write_text("e")
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        start_history(str(tmp_path), 0, "second\n", "tb", world_size=1)
    assert [r.getMessage() for r in caplog.records] == [
        "earlier run's metrics.jsonl/config.toml/tb moved to metrics.1.jsonl/config.1.toml/tb.1: this folder's "
        "metrics.jsonl is this run's"]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.1.jsonl")] == [1, 2, 3, 4, 5]
    assert (tmp_path / "config.1.toml").read_text() == "first\n"
    assert (tmp_path / "tb.1" / "events.out.tfevents.1").exists()
    assert (tmp_path / "config.toml").read_text() == "second\n" and not (tmp_path / "metrics.jsonl").exists()

    write(tmp_path / "metrics.jsonl", *steps(1, 2))  # the second run logged; a third starts afresh
    start_history(str(tmp_path), 0, "third\n", "tb", world_size=1)
    assert (tmp_path / "config.2.toml").read_text() == "second\n" and (tmp_path / "metrics.2.jsonl").exists()
    assert not (tmp_path / "tb.2").exists()  # the second run wrote no events
    start_history(str(tmp_path), 0, "fourth\n", "tb", world_size=1)  # the third logged nothing: nothing to keep
    assert sorted(os.listdir(tmp_path)) == ["config.1.toml", "config.2.toml", "config.toml", "metrics.1.jsonl",
                                            "metrics.2.jsonl", "tb.1"]


def test_rerunning_the_dumped_config_in_its_folder_keeps_both_runs_apart(tmp_path):
    """The README's reproduce command, `--job.config_file outputs/config.toml`, which names its own folder."""
    first = train_in_process(tmp_path, "--training.steps", "2")
    earlier = (tmp_path / "metrics.jsonl").read_text(), (tmp_path / "config.toml").read_text()
    again = train_in_process(tmp_path, config=tmp_path / "config.toml")
    assert "moved to" not in first.stdout
    assert again.stdout.count("earlier run's metrics.jsonl/config.toml moved to metrics.1.jsonl/config.1.toml") == 1
    assert ((tmp_path / "metrics.1.jsonl").read_text(), (tmp_path / "config.1.toml").read_text()) == earlier
    assert f'config_file = "{tmp_path / "config.toml"}"' in (tmp_path / "config.toml").read_text()  # this run's
    reproduced = [(m["step"], m["loss"]) for m in read_metrics(tmp_path)]
    assert reproduced == [(m["step"], m["loss"]) for m in read_metrics(tmp_path / "metrics.1.jsonl")]
    assert len(reproduced) == 2
