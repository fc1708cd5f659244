"""torchtitan_lite/runtime/run_history.py: one dump folder, each run's history whole. Reading metrics.jsonl (resume
records, spliced runs refused), a resume continuing its own run's history and cutting the records past its
checkpoint, a fresh start moving an earlier run aside, and the trainer doing so when runs share a folder."""

import json
import logging
import os
import tomllib

import pytest

from tests.multiprocess.launch import ckpt, read_metrics, resumes, train_in_process
from torchtitan_lite.checkpoint.folder import read_run_files
from torchtitan_lite.runtime.run_history import HistoryError, history_run, read_history, start_history


def write(path, *records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def steps(n, m, loss=1.0):
    return [{"step": s, "loss": loss + s} for s in range(n, m + 1)]


def start(run):
    return {"event": "start", "run": run, "step": 0, "world_size": 1}


def test_a_resume_record_lets_steps_go_back_and_the_later_record_wins(tmp_path):
    # Logged 1-4, resumed from step 2's checkpoint, logged 3-5 again: a file joined by hand, not cut back.
    path = write(tmp_path / "m.jsonl", start("a"), *steps(1, 4), {"event": "resume", "step": 2, "world_size": 2},
                 *steps(3, 5, loss=10.0), {"event": "other", "step": 1})
    records, resumes = read_history(path)
    assert [(r["step"], r["loss"]) for r in records] == [(1, 2.0), (2, 3.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    assert resumes == [{"event": "resume", "step": 2, "world_size": 2}]
    assert read_metrics(tmp_path / "m.jsonl") == records  # the tests' reader is the library's, events skipped


@pytest.mark.parametrize("records", [[*steps(1, 5), *steps(1, 2)], [*steps(1, 3), *steps(3, 4)],
                                     [start("a"), *steps(1, 3), start("b"), *steps(4, 5)]],
                         ids=["rerun", "repeated", "second-start"])
def test_two_runs_in_one_file_are_refused(tmp_path, records):
    path = write(tmp_path / "m.jsonl", *records)
    with pytest.raises(HistoryError, match=r"m.jsonl:\d: (step \d after step \d with no resume record between|a "
                                           r"second run starts here): two runs' records in one file"):
        read_history(path)


def test_a_resume_cuts_the_records_past_its_step_and_marks_the_seam(tmp_path):
    metrics = write(tmp_path / "metrics.jsonl", start("a"), *steps(1, 6))
    with open(metrics, "a") as f:
        f.write('{"step": 7, "lo')  # torn by the crash
    (tmp_path / "config.toml").write_text("steps = 6\n")
    assert start_history(str(tmp_path), 4, "a", "steps = 6\n", "tb", world_size=2) == "a"
    records, resumes = read_history(metrics)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert resumes == [{"event": "resume", "run": "a", "step": 4, "world_size": 2}]
    assert sorted(os.listdir(tmp_path)) == ["config.toml", "metrics.jsonl"]  # no temporary file left


def test_a_resume_under_another_config_names_what_changed(tmp_path):
    write(tmp_path / "metrics.jsonl", start("a"), *steps(1, 4))
    before = '[training]\nsteps = 6\nseed = 1\n\n[job]\ndescription = "x"\n'
    after = '[training]\nsteps = 8\nseed = 1\n\n[job]\ndescription = "y"\n'
    start_history(str(tmp_path), 4, "a", after, "tb", world_size=1, checkpoint_config=before)
    assert (tmp_path / "config.toml").read_text() == after  # the current run's; the checkpoint holds its own
    assert read_history(tmp_path)[1][0]["changed"] == {"job.description": ["x", "y"], "training.steps": [6, 8]}


def test_a_crash_while_cutting_leaves_the_file_whole(tmp_path, monkeypatch):
    metrics = write(tmp_path / "metrics.jsonl", start("a"), *steps(1, 6))
    before = open(metrics).read()
    def killed(*args):
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(OSError):
        start_history(str(tmp_path), 4, "a", "", "tb", world_size=1)
    assert open(metrics).read() == before


def test_a_fresh_start_moves_the_earlier_run_aside_under_the_next_free_number(tmp_path, caplog):
    write(tmp_path / "metrics.jsonl", start("a"), *steps(1, 5))
    (tmp_path / "config.toml").write_text("first\n")
    (tmp_path / "wandb_run_id").write_text("w1\n")
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1").write_text("e")
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        second = start_history(str(tmp_path), 0, None, "second\n", "tb", world_size=1)
    assert [r.getMessage() for r in caplog.records] == [
        "earlier run's metrics.jsonl/config.toml/tb/wandb_run_id moved to metrics.1.jsonl/config.1.toml/tb.1/"
        "wandb_run_id.1: this folder's metrics.jsonl is this run's"]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.1.jsonl")] == [1, 2, 3, 4, 5]
    assert (tmp_path / "config.1.toml").read_text() == "first\n" and (tmp_path / "wandb_run_id.1").is_file()
    assert (tmp_path / "tb.1" / "events.out.tfevents.1").exists()
    assert (tmp_path / "config.toml").read_text() == "second\n" and history_run(str(tmp_path / "metrics.jsonl")) \
        == second != "a" and read_metrics(tmp_path) == []

    with open(tmp_path / "metrics.jsonl", "a") as f:  # the second run logged; a third starts afresh
        f.writelines(json.dumps(r) + "\n" for r in steps(1, 2))
    start_history(str(tmp_path), 0, None, "third\n", "tb", world_size=1)
    assert (tmp_path / "config.2.toml").read_text() == "second\n" and (tmp_path / "metrics.2.jsonl").exists()
    assert not (tmp_path / "tb.2").exists()  # the second run wrote no events
    start_history(str(tmp_path), 0, None, "fourth\n", "tb", world_size=1)  # the third logged nothing: nothing kept
    assert sorted(os.listdir(tmp_path)) == ["config.1.toml", "config.2.toml", "config.toml", "metrics.1.jsonl",
                                            "metrics.2.jsonl", "metrics.jsonl", "tb.1", "wandb_run_id.1"]


def test_a_resume_continues_its_own_runs_history_not_the_folders_latest(tmp_path):
    """The README's tours in one folder: run a (checkpointed) to step 6, run b afresh beside it without
    checkpoints, then a's checkpoint at step 4 resumed. a's history comes back and is cut at 4; b's is moved aside
    whole. Before run ids, the resume cut b's records past step 4 and spliced a's steps onto b's curve."""
    write(tmp_path / "metrics.jsonl", start("a"), *steps(1, 6))
    (tmp_path / "config.toml").write_text("a\n")
    start_history(str(tmp_path), 0, None, "b\n", "tb", world_size=1)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in steps(1, 50, loss=100.0))
    b = history_run(str(tmp_path / "metrics.jsonl"))
    assert start_history(str(tmp_path), 4, "a", "a2\n", "tb", world_size=1) == "a"
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]  # a's, cut at its checkpoint
    assert resumes(tmp_path) == [{"event": "resume", "run": "a", "step": 4, "world_size": 1}]
    assert history_run(str(tmp_path / "metrics.2.jsonl")) == b  # b's, whole
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.2.jsonl")] == list(range(1, 51))
    assert (tmp_path / "config.toml").read_text() == "a2\n" and (tmp_path / "config.2.toml").read_text() == "b\n"


def test_a_resume_whose_run_left_no_history_here_starts_one_and_keeps_the_folders(tmp_path):
    write(tmp_path / "metrics.jsonl", start("b"), *steps(1, 3))
    assert start_history(str(tmp_path), 4, "a", "", "tb", world_size=1) == "a"
    assert read_history(tmp_path) == ([], [{"event": "resume", "run": "a", "step": 4, "world_size": 1}])
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.1.jsonl")] == [1, 2, 3]


def test_a_folder_older_than_run_ids_is_one_run_as_before(tmp_path):
    write(tmp_path / "metrics.jsonl", *steps(1, 6))  # no start record, and a checkpoint naming no run
    run = start_history(str(tmp_path), 4, None, "", "tb", world_size=1)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4] and history_run(
        str(tmp_path / "metrics.jsonl")) == run  # from here on, a run with an id: its next resume continues it
    assert start_history(str(tmp_path), 2, run, "", "tb", world_size=1) == run
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_runs_sharing_a_folder_keep_their_histories_and_each_checkpoint_its_config(tmp_path):
    """The trainer: a checkpointed run, a fresh one beside it without checkpoints (told what happens to the
    checkpoints), then the first extended. Every run's records stay whole, each checkpoint names its run and holds
    the config that wrote it, and the resume says what changed."""
    first = train_in_process(tmp_path, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2")
    beside = train_in_process(tmp_path, "--training.steps", "3")
    assert (f"{tmp_path / 'checkpoint'} holds step-2 and step-4 of run {history_run(str(tmp_path / 'metrics.1.jsonl'))}"
            ": checkpoint.enable is off, so this run starts afresh and leaves them as they are (with "
            "--checkpoint.enable it would resume step-4)") in beside.stdout
    extended = train_in_process(tmp_path, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval",
                                "2")
    run = history_run(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 7))
    assert resumes(tmp_path) == [{"event": "resume", "run": run, "step": 4, "world_size": 1,
                                  "changed": {"training.steps": [4, 6]}}]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.2.jsonl")] == [1, 2, 3]  # the fresh run's, whole
    for step, steps_then in ((2, 4), (4, 4), (6, 6)):
        saved_by, config = read_run_files(str(ckpt(tmp_path, step)))
        assert saved_by == run and tomllib.loads(config)["training"]["steps"] == steps_then
    assert f"run {run}'s history (metrics.1.jsonl) is this folder's metrics.jsonl again" in extended.stdout
    assert "moved to" not in first.stdout


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
