"""The metric logger (runtime/metric_logger.py): metrics.jsonl's exact floats and its one writer, the console line,
TensorBoard, and which steps are logged."""

import logging
import math
import os
import shutil
import tomllib

import pytest
import torch

from tests.multiprocess.launch import ckpt, losses, read_metrics, resumes, train_in_process
from torchtitan_lite.checkpoint.folder import read_run_files
from torchtitan_lite.runtime import metrics
from torchtitan_lite.runtime.metric_logger import MetricLogger


def test_jsonl_round_trips_exact_floats_and_appends(tmp_path):
    values = {"loss": 1 / 3, "grad_norm": torch.tensor(2.0, dtype=torch.float64) / 3, "lr": math.pi * 1e-4,
              "tps": 12345.678, "mfu": 1.2345, "memory_gib": 0.45, "elapsed_s": 0.1}
    ml = MetricLogger(str(tmp_path), rank=0, log_freq=10, enable_tensorboard=False, tb_folder="tb")
    ml.log(1, values)
    ml.close()
    ml = MetricLogger(str(tmp_path), rank=0, log_freq=10, enable_tensorboard=False, tb_folder="tb")
    ml.log(2, {**values, "loss": 0.1})
    ml.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == 1 / 3 and rows[0]["lr"] == math.pi * 1e-4
    assert rows[0]["grad_norm"] == 2 / 3 and type(rows[0]["grad_norm"]) is float
    assert rows[1]["loss"] == 0.1


def test_other_ranks_write_nothing(tmp_path, caplog):
    ml = MetricLogger(str(tmp_path), rank=1, log_freq=1, enable_tensorboard=True, tb_folder="tb")
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        ml.log(1, {"loss": 1.0})
    ml.close()
    assert os.listdir(tmp_path) == []
    assert caplog.text == ""


def test_console_line_shape(tmp_path, caplog):
    ml = MetricLogger(str(tmp_path), rank=0, log_freq=1, enable_tensorboard=False, tb_folder="tb")
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        ml.log(3, {"loss": 5.12345, "grad_norm": 1.23454, "lr": 8e-4, "tps": 12345.4, "mfu": 1.234,
                   "memory_gib": 0.449, "elapsed_s": 1.0})
        ml.log(4, {"val_loss": 4.5})
    ml.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("step: 3  loss: 5.1235  grad_norm: 1.2345  lr: 8.0000e-04  tps: 12,345  mfu: 1.23%  "
                        "memory: 0.45GiB")
    assert lines[1] == "step: 4  val_loss: 4.5000"


def test_a_mixture_of_experts_console_line_adds_its_worst_load_and_router_losses(tmp_path, caplog):
    """The busiest expert over the mean in the worst layer, then the auxiliary loss and router z-loss where logged,
    and the fraction of the slots dropped over capacity; the dense line is unchanged (test_console_line_shape) and
    the per-layer figures stay in metrics.jsonl."""
    ml = MetricLogger(str(tmp_path), rank=0, log_freq=1, enable_tensorboard=False, tb_folder="tb")
    moe = {"loss": 5.0, "memory_gib": 0.449, "routed_slots": 2048.0, "expert_load/layers.0.moe": 1.2345,
           "expert_load/layers.1.moe": 1.4212, "aux_loss": 2.01234}
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        ml.log(1, moe)
        ml.log(2, {**moe, "router_z_loss": 3.5, "z_loss": 9.0, "dropped": 0.03125})
        ml.log(3, {k: v for k, v in moe.items() if k != "aux_loss"})
    ml.close()
    assert [r.getMessage() for r in caplog.records] == [
        "step: 1  loss: 5.0000  memory: 0.45GiB  load: 1.42  aux_loss: 2.0123",
        "step: 2  loss: 5.0000  memory: 0.45GiB  load: 1.42  aux_loss: 2.0123  router_z_loss: 3.5000  dropped: 0.0312",
        "step: 3  loss: 5.0000  memory: 0.45GiB  load: 1.42"]
    assert read_metrics(tmp_path)[0]["expert_load/layers.0.moe"] == 1.2345


def test_console_says_where_the_run_is_and_when_it_ends(tmp_path, caplog, monkeypatch):
    """k/N and the time left: from the first logged step's window (start-up included) until a second log gives the
    pace of steps alone, measured from the first logged step on."""
    clock = iter([100.0, 130.0, 150.0, 170.0])  # the logger's start, then each log
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    ml = MetricLogger(str(tmp_path), rank=0, log_freq=1, enable_tensorboard=False, tb_folder="tb", start_step=0,
                      total_steps=10)
    with caplog.at_level(logging.INFO, logger="torchtitan_lite"):
        for step in (3, 5, 10):
            ml.log(step, {"loss": 1.0})
    ml.close()
    assert [r.getMessage() for r in caplog.records] == [
        "step: 3/10  loss: 1.0000  eta: 1m10s",  # 30 s for 3 steps, 7 to go
        "step: 5/10  loss: 1.0000  eta: 50s",  # 20 s for steps 4-5, 5 to go
        "step: 10/10  loss: 1.0000  eta: 0s"]
    assert ml.last == {"step": 10, "loss": 1.0}


def test_tensorboard_writes_event_file(tmp_path):
    pytest.importorskip("tensorboard")
    ml = MetricLogger(str(tmp_path), rank=0, log_freq=1, enable_tensorboard=True, tb_folder="tb")
    ml.log(1, {"loss": 1.0, "lr": 1e-3})
    ml.close()
    events = [f for f in os.listdir(tmp_path / "tb") if f.startswith("events.out.tfevents")]
    assert len(events) == 1 and os.path.getsize(tmp_path / "tb" / events[0]) > 0


def _tensorboard_events(folder):
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(folder), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})  # 0: keep every event
    acc.Reload()
    return acc


def test_tensorboard_resumed_run_shows_each_step_once_with_its_later_value_and_the_config(tmp_path):
    pytest.importorskip("tensorboard")
    flags = ("--checkpoint.enable", "--checkpoint.interval", "2", "--metrics.enable_tensorboard")
    train_in_process(tmp_path, "--training.steps", "6", *flags)
    shutil.rmtree(ckpt(tmp_path, 6))  # as if it had crashed before saving step 6: steps 5 and 6 are logged again
    # Tighter clipping after the resume changes step 6's loss, so the stale record and the new one can be told apart.
    train_in_process(tmp_path, "--training.steps", "8", "--training.max_norm", "0.01", *flags)
    # metrics.jsonl: the crashed run's steps 5 and 6 cut, each step once, the resume marked, both configs kept.
    later = losses(tmp_path)
    assert list(later) == list(range(1, 9))
    assert [(r["step"], r["changed"]) for r in resumes(tmp_path)] == [
        (4, {"training.max_norm": [1.0, 0.01], "training.steps": [6, 8]})]
    assert tomllib.loads(read_run_files(str(ckpt(tmp_path, 4)))[1])["training"]["steps"] == 6

    acc = _tensorboard_events(tmp_path / "tb")
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == list(range(1, 9))
    # TensorBoard stores scalars as float32.
    assert [e.value for e in loss] == [torch.tensor(later[s]).item() for s in range(1, 9)]
    # Each run's config at its first step; the resumed run's is the config.toml it wrote.
    text = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("config/text_summary")}
    assert sorted(text) == [1, 5]
    assert text[5] == f"```toml\n{(tmp_path / 'config.toml').read_text()}```"
    assert tomllib.loads(text[1].removeprefix("```toml").removesuffix("```"))["training"]["steps"] == 6


def test_should_log_first_every_freq_and_last(tmp_path):
    ml = MetricLogger(str(tmp_path), rank=1, log_freq=5, enable_tensorboard=False, tb_folder="tb")
    assert [s for s in range(1, 13) if ml.should_log(s)] == [1, 5, 10]
    assert ml.should_log(12, last=True)


def test_a_step_the_file_holds_already_is_not_written_again(tmp_path, caplog):
    """Two writers of one metrics.jsonl, as replica groups hand the writing over: each appends past the file's last
    step, whoever wrote it, and one behind the run (a group left alone after the others finished) writes nothing."""
    a, b = (MetricLogger(str(tmp_path), rank=0, log_freq=1, enable_tensorboard=False, tb_folder="tb")
            for _ in range(2))
    a.log(1, {"loss": 1.0})
    b.log(2, {"loss": 2.0})  # a has died: b writes
    a.log(3, {"loss": 3.0})  # a is back and first again
    with caplog.at_level(logging.WARNING, logger="torchtitan_lite"):
        b.log(2, {"loss": 9.0})  # b, stale, alone
        b.log(3, {"loss": 9.0})
        b.log(4, {"loss": 4.0})  # past the file's last step: its own again
    a.close()
    b.close()
    assert [(m["step"], m["loss"]) for m in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert [r.getMessage() for r in caplog.records] == [
        "metrics.jsonl already holds step 3: this job's records up to it are not written (it is behind the run)"]
