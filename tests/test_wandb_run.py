"""W&B's optional package and run id (runtime/wandb_run.py); its records against metrics.jsonl are checked on a real
2-process job in tests/multiprocess/test_profiling.py."""

import importlib.util

import pytest

import train
from launch import TINY
from torchtitan_lite.runtime.wandb_run import ID_FILE, run_id


def test_check_says_in_one_line_that_wandb_is_missing(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    assert train.run(["--job.config_file", str(TINY), "--metrics.enable_wandb"], check=True) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install wandb" in err[0] and "--no-metrics.enable_wandb" in err[0]


@pytest.mark.parametrize("resumed, env, expected", [(False, None, "new"), (True, None, "old"),
                                                    (True, "given", "given"), (False, "given", "given")])
def test_a_resumed_job_logs_into_its_run(tmp_path, monkeypatch, resumed, env, expected):
    (tmp_path / ID_FILE).write_text("old\n")
    if env:
        monkeypatch.setenv("WANDB_RUN_ID", env)
    else:
        monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    assert run_id(str(tmp_path), resumed, lambda: "new") == expected
    assert (tmp_path / ID_FILE).read_text() == expected + "\n"
