"""train.py in-process on one process: gradient accumulation gives one big batch's curve."""

import gc
import logging
import re
import subprocess
import sys

import pytest
import torch

import train
from torchtitan_lite.config import load_config
from torchtitan_lite.models.common.decoder import count_params
from torchtitan_lite.models.llama3.model import Transformer
from torchtitan_lite.tools.memory import model_args
from tests.multiprocess.launch import ROOT, TINY, read_metrics


def n_params(config) -> int:
    with torch.device("meta"):
        return count_params(Transformer(model_args(load_config(["--job.config_file", str(config)]))[0]))[0]


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


def test_a_run_leaves_automatic_garbage_collection_as_it_found_it(tmp_path):
    """The loop turns automatic collection off (it collects every training.gc_freq steps); the caller gets back what it
    had: on in this process, off in one started with it off, as the suite's are (tests/quick_exit/sitecustomize.py),
    where turning it on would walk every object torch made (0.17 s) on the way out."""
    for collecting in (True, False):
        if not collecting:
            gc.disable()
        try:
            assert train.run(["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path / str(collecting)),
                              "--training.steps", "1"]) == 0
            assert gc.isenabled() == collecting
        finally:
            gc.enable()


def test_config_error_returns_2_and_prints_one_line(tmp_path, capsys):
    assert train.run(["--job.config_file", str(TINY), "--training.seq_len", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "training.seq_len" in err[0]


def test_start_up_says_the_plan_and_one_warning_of_options_its_layout_ignores_and_the_end_says_where_it_went(
        tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="torchtitan_lite")
    assert train.run(["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path), "--training.steps", "1",
                      "--parallelism.context_parallel_load_balancer", "none"]) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "ignored" in m] == [
        "no context parallelism in this layout (context_parallel_degree = 1): "
        "parallelism.context_parallel_load_balancer ignored"]
    # The config is in config.toml, not on the console (job.print_args puts it there: the test below).
    assert [m for m in messages if "parameters" in m or "[training]" in m or " tokens " in m or "outputs" in m] == [
        f"llama3 tiny: {n_params(TINY) / 1e6:.2f}M parameters, 1 process, causal attention, float32",
        "data synthetic: 1 step of 2 x 64 = 128 tokens (2 sequences a rank per micro-batch, 1 micro-batch)",
        f"outputs in {tmp_path}: metrics.jsonl, config.toml; checkpoints off"]
    loss = read_metrics(tmp_path)[0]["loss"]
    assert re.fullmatch(rf"training done at step 1/1: 1 step in [\d.]+ s by this run; loss {loss:.4f} at step 1; "
                        rf"metrics in {tmp_path}/metrics.jsonl; plot: python scripts/plot_metrics.py {tmp_path} --out "
                        r"curves.png", messages[-1]), messages[-1]


def test_dumped_config_alone_reproduces_the_run_and_print_args_shows_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="torchtitan_lite")
    first = curve(tmp_path, "first", "--training.local_batch_size", "3", "--optimizer.lr", "3e-4")
    again = tmp_path / "again"
    # The dumped config names its own dump folder; only the output location is overridden, and the console shown it.
    assert train.run(["--job.config_file", str(tmp_path / "first" / "config.toml"),
                      "--job.dump_folder", str(again), "--job.print_args"]) == 0
    assert [m["loss"] for m in read_metrics(again)] == first
    assert [r.getMessage() for r in caplog.records if "[training]" in r.getMessage()] == [
        f"resolved config:\n{(again / 'config.toml').read_text()}"]


def test_start_up_imports_no_dynamo():
    """run_train.sh's preflight (`train.py --check`) and a job that stops at a bad config import train.py and no
    more: torch._dynamo would add ~0.5 s before their one line (1.9 s in all, 2.4-2.6 s with it). A module-level
    `torch.nn.attention.bias` import once brought it in; training itself imports it later, building on meta."""
    code = "import sys, train; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
