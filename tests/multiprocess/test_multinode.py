"""Several torchrun agents joined by a c10d rendezvous, as on several machines (here all on 127.0.0.1): two agents of
2 processes train like one agent of 4, and an elastic job (--nnodes 1:2) that gains a node and then loses one goes
on from its newest checkpoint on every size, on the uninterrupted curve, with its global batch unchanged."""

import itertools
import os
import signal
import socket
import subprocess
import time

import pytest
from launch import (
    CHECKPOINTED,
    COMMON,
    ROOT,
    STEPS,
    TIMEOUT_S,
    TINY,
    TP2_FSDP2,
    descendants,
    kill_tree,
    losses,
    read_metrics,
    running,
    torchrun_cmd,
)

GATE = ROOT / "tests" / "multiprocess" / "gate.py"
# Recovery bounds (README, "Running on a cluster"): a round closes 1 s after its minimum of nodes is there, and a
# node silent for 10 heartbeats of 1 s (one is sent every second) is dropped from the next round.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=10"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(nnodes: str, port: int, run_id: str, script, *args: str) -> subprocess.Popen:
    """One node's torchrun: 2 processes, rendezvous on 127.0.0.1:port."""
    cmd, env = torchrun_cmd(2, script, *args, launcher=(
        "--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        "--rdzv-conf", RDZV_CONF, "--max-restarts", "3"))
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as run_train.sh and multinode_trainer.slurm set it
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(*agents: subprocess.Popen) -> list[str]:
    """Each agent's output once it exits; none outlives the test."""
    try:
        return [a.communicate(timeout=TIMEOUT_S)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                kill_tree(a)


def wait_until(condition, what: str, *agents: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT_S  # a hang detector, not a timing
    while not condition():
        for a in agents:
            assert a.poll() is None, f"an agent ended before {what}:\n{a.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {TIMEOUT_S}s"
        time.sleep(0.05)


def train_args(folder) -> tuple[str, ...]:
    return ("--job.config_file", str(TINY), "--job.dump_folder", str(folder), *COMMON, "--training.steps", str(STEPS))


def test_two_agents_of_two_processes_train_like_one_agent_of_four(runs, tmp_path):
    port = free_port()
    a, b = (agent("2", port, "two", ROOT / "train.py", *train_args(tmp_path), *TP2_FSDP2) for _ in range(2))
    outs = finish(a, b)
    assert a.returncode == b.returncode == 0, "\n".join(o[-2000:] for o in outs)
    assert {m["world_size"] for m in read_metrics(tmp_path)} == {4}
    assert losses(tmp_path) == pytest.approx(losses(runs["tp2_fsdp2"]), abs=1e-6, rel=0)


def test_elastic_job_grows_then_shrinks_on_the_uninterrupted_curve(runs, tmp_path):
    """Agent A starts alone and is held before step 3; agent B joins and torchrun stops A's workers, which agree on
    a step to stop after (the next one, 4) and save it; 4 processes resume. Held before step 6, B's launcher is
    SIGKILLed: its workers, orphans now, stop by themselves, A's fail on their next collective, and A alone resumes
    from step 4. Global batch 8 throughout: 2 micro-batches of 2 per rank on 2 processes, 1 on 4."""
    port, metrics = free_port(), tmp_path / "metrics.jsonl"
    for step in (3, 6):
        (tmp_path / f"hold-{step}").touch()
    args = (GATE, str(tmp_path), *train_args(tmp_path), *CHECKPOINTED)
    a = agent("1:2", port, "elastic", *args)
    b = None
    try:
        wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) == 2, "step 2 on 2 processes", a)
        b = agent("1:2", port, "elastic", *args)
        wait_until(lambda: read_metrics(tmp_path)[-1]["step"] == 5, "step 5 on 4 processes", a, b)
        orphans = descendants(b.pid)
        os.kill(b.pid, signal.SIGKILL)
        b_out = b.communicate(timeout=TIMEOUT_S)[0]  # ends when the orphans, its pipe's last writers, have stopped
        # Gone within moments: each closed its end of the pipe as it exited, just before it stopped running.
        wait_until(lambda: not [pid for pid in orphans if running(pid)], "the orphans' exit", a)
        assert "the launcher (pid" in b_out and "is gone" in b_out, b_out[-3000:]
        (tmp_path / "hold-6").unlink()
        a_out = finish(a)[0]
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                kill_tree(proc)
    assert a.returncode == 0, a_out[-3000:]
    steps, sizes = zip(*[(m["step"], m["world_size"]) for m in read_metrics(tmp_path)])
    assert [size for size, _ in itertools.groupby(sizes)] == [2, 4, 2], (steps, sizes)
    grown = sizes.index(4)
    shrunk = grown + sizes[grown:].index(2)
    # Growing loses no step (the stopped workers saved the step they were at: 4, or 3 had B come sooner); shrinking
    # redoes the steps after the newest checkpoint (4, saved every 2 steps).
    assert steps[:shrunk] == tuple(range(1, shrunk + 1)) and steps[grown - 1] in (3, 4), (steps, sizes)
    assert steps[shrunk:] == tuple(range(5, 9)), (steps, sizes)
    assert losses(tmp_path) == pytest.approx(losses(runs["fsdp4"]), abs=1e-5, rel=0)
