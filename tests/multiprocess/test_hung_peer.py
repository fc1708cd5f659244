"""A rank that stops responding (SIGSTOP) ends the job once its peers' collective timeout runs out, with one line
naming the cause and the option that bounds the wait (comm.train_timeout_seconds, in force after the first step),
instead of a job that hangs forever. The job is a 2-stage pipeline: rank 0 waits on its stopped peer in a
point-to-point receive as well as in collectives.

When the stopped rank is rank 0, the one that speaks for the job, the survivor says it after giving rank 0 a training
timeout to speak. That leg runs as run_train.sh does (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), where the store errors.py
talked through lived in rank 0 and a stopped rank 0 held the survivor there forever."""

import os
import signal
import subprocess
import time

import pytest
from launch import COMMON, PP2, TIMEOUT_S, TINY, TRAIN, descendants, kill_tree, running, torchrun_cmd


@pytest.mark.parametrize("stopped, store_env", [(1, {}), (0, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})])
def test_stopped_rank_ends_the_job_with_the_reason(tmp_path, stopped, store_env):
    cmd, env = torchrun_cmd(2, TRAIN, "--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path), *COMMON,
                            "--training.steps", "1000", "--comm.train_timeout_seconds", "3", *PP2)
    env.update(store_env)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = []
    try:
        metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + TIMEOUT_S  # hang detector, not a timing
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "the job never reached step 3"
            time.sleep(0.05)
        workers = sorted(descendants(proc.pid))  # spawned in rank order
        survivor = workers[1 - stopped]
        os.kill(workers[stopped], signal.SIGSTOP)
        while running(survivor):
            assert time.monotonic() < deadline, "the surviving rank never gave up on its stopped peer"
            time.sleep(0.1)
        os.kill(workers[stopped], signal.SIGKILL)  # what torchrun does to a stopped worker 30 s after its SIGTERM
        out = proc.communicate(timeout=TIMEOUT_S)[0]
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode != 0
    # rank 1 speaks for a stopped rank 0 in torchrun's failure summary, shown whatever run_train.sh's LOG_RANK
    said = "error: " if stopped else "traceback : error: rank 1: "
    lines = [line for line in out.splitlines() if "a collective waited longer than" in line and "error: " in line]
    assert len(lines) == 1 and said in lines[0], out[-3000:]
    assert "comm.train_timeout_seconds = 3 s: a peer rank is hung" in lines[0], out[-3000:]
