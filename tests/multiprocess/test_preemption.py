"""Preemption through ./run_train.sh, as Slurm or Kubernetes deliver it: SIGTERM (or Slurm's SIGUSR1 warning) to
the launch script makes every rank finish the step it is in, save a checkpoint of that step and exit 0; a second
signal while that checkpoint is being written does not spoil it. The second case runs a 2-stage pipeline: both
stages stop after the same step and save it."""

import os
import signal
import subprocess
import sys

import pytest

from launch import PP2, ROOT, TINY, TIMEOUT_S, kill_tree, logged, read_metrics, wait_until
from torchtitan_lite.checkpoint import complete_checkpoints


@pytest.mark.parametrize("signals, layout", [(("SIGTERM",), ()), (("SIGUSR1", "SIGTERM"), PP2)],
                         ids=["SIGTERM", "SIGUSR1_SIGTERM_pp2"])
def test_signal_saves_the_current_step_and_exits_0(tmp_path, signals, layout):
    env = {**os.environ, "NGPU": "2", "CONFIG_FILE": str(TINY), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "",
           # The second signal lands while the checkpoint is written: its last moment is held open 3 s.
           "TORCHTITAN_LITE_TEST_PAUSE_BEFORE_METADATA_S": "3" if len(signals) > 1 else "0"}
    cmd = ["./run_train.sh", "--job.dump_folder", str(tmp_path), "--training.steps", "1000", "--checkpoint.enable",
           "--checkpoint.interval", "500", *layout]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: logged(tmp_path) >= 3, "step 3", proc)
        proc.send_signal(getattr(signal, signals[0]))
        if len(signals) > 1:
            folder = tmp_path / "checkpoint"
            wait_until(lambda: folder.exists() and any(p.suffix == ".tmp" for p in folder.iterdir()), "save", proc)
            proc.send_signal(getattr(signal, signals[1]))
        out = proc.communicate(timeout=TIMEOUT_S)[0]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 0, out[-3000:]
    last = read_metrics(tmp_path)[-1]["step"]
    assert 3 <= last < 1000 and f"{signals[0]}: stopped after step {last}, checkpoint saved" in out
    assert list(complete_checkpoints(str(tmp_path / "checkpoint"))) == [last]
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "checkpoint").iterdir())
