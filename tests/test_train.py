"""train.py in-process on one process: gradient accumulation gives one big batch's curve."""

import subprocess
import sys

import pytest

import train
from tests.multiprocess.launch import ROOT, TINY, read_metrics


def curve(tmp_path, name, *overrides):
    folder = tmp_path / name
    code = train.run(["--job.config_file", str(TINY), "--job.dump_folder", str(folder), "--training.steps", "4",
                      *overrides])
    assert code == 0
    return [m["loss"] for m in read_metrics(folder)]


def test_accumulation_matches_one_big_batch(tmp_path):
    big = curve(tmp_path, "big", "--training.local_batch_size", "4", "--training.global_batch_size", "4")
    for local in ("1", "2"):
        accumulated = curve(tmp_path, f"acc{local}", "--training.local_batch_size", local,
                            "--training.global_batch_size", "4")
        assert accumulated == pytest.approx(big, abs=2e-6)
    # A different global batch is a different curve: the comparison above can fail.
    assert curve(tmp_path, "other", "--training.global_batch_size", "8") != pytest.approx(big, abs=1e-3)


def test_config_error_returns_2_and_prints_one_line(tmp_path, capsys):
    assert train.run(["--job.config_file", str(TINY), "--training.seq_len", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "training.seq_len" in err[0]


def test_a_run_warns_once_of_options_its_layout_ignores(tmp_path, caplog):
    assert train.run(["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path), "--training.steps", "1",
                      "--parallelism.context_parallel_load_balancer", "none"]) == 0
    assert [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()] == [
        "no context parallelism in this layout (context_parallel_degree = 1): "
        "parallelism.context_parallel_load_balancer ignored"]


def test_dumped_config_alone_reproduces_the_run(tmp_path):
    first = curve(tmp_path, "first", "--training.local_batch_size", "3", "--optimizer.lr", "3e-4")
    again = tmp_path / "again"
    # The dumped config names its own dump folder; only the output location is overridden.
    assert train.run(["--job.config_file", str(tmp_path / "first" / "config.toml"),
                      "--job.dump_folder", str(again)]) == 0
    assert [m["loss"] for m in read_metrics(again)] == first


def test_start_up_imports_no_dynamo():
    """run_train.sh's preflight (`train.py --check`) and a job that stops at a bad config import train.py and no
    more: torch._dynamo would add ~0.5 s before their one line (1.9 s in all, 2.4-2.6 s with it). A module-level
    `torch.nn.attention.bias` import once brought it in; training itself imports it later, building on meta."""
    code = "import sys, train; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
