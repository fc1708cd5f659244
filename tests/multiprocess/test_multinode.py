"""Several torchrun agents joined by a c10d rendezvous, as on several machines (here all on 127.0.0.1): two agents of
2 processes train like one agent of 4, and an elastic job (--nnodes 1:2) that gains a node and then loses one goes
on from its newest checkpoint on every size, on the uninterrupted curve, with its global batch unchanged."""

import itertools
import os
import signal
import subprocess

from launch import (CHECKPOINTED, COMMON, GATE, STEPS, TIMEOUT_S, TP2_FSDP2, TRAIN, agent, assert_same_curve,
                    descendants, free_port, kill_tree, logged, losses, read_metrics, resumes, running, train_argv,
                    wait_until)


def finish(*agents: subprocess.Popen) -> list[str]:
    """Each agent's output once it exits; none outlives the test."""
    try:
        return [a.communicate(timeout=TIMEOUT_S)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                kill_tree(a)


def test_two_agents_of_two_processes_train_like_one_agent_of_four(runs, tmp_path):
    port = free_port()
    args = train_argv(tmp_path, *COMMON, "--training.steps", str(STEPS), *TP2_FSDP2)
    a, b = (agent("2", port, "two", TRAIN, *args) for _ in range(2))
    outs = finish(a, b)
    assert a.returncode == b.returncode == 0, "\n".join(o[-2000:] for o in outs)
    assert {m["world_size"] for m in read_metrics(tmp_path)} == {4}
    assert sorted(losses(tmp_path)) == sorted(losses(runs["tp2_fsdp2"]))
    assert_same_curve(tmp_path, runs["tp2_fsdp2"], 1e-6)


def test_elastic_job_grows_then_shrinks_on_the_uninterrupted_curve(runs, tmp_path):
    """Agent A starts alone and is held before step 3; agent B joins and torchrun stops A's workers, which agree on
    a step to stop after (the next one, 4) and save it; 4 processes resume. Held before step 6, B's launcher is
    SIGKILLed: its workers, orphans now, stop by themselves, A's fail on their next collective, and A alone resumes
    from step 4. Global batch 8 throughout: 2 micro-batches of 2 per rank on 2 processes, 1 on 4."""
    port = free_port()
    for step in (3, 6):
        (tmp_path / f"hold-{step}").touch()
    args = (GATE, str(tmp_path), *train_argv(tmp_path, *COMMON, "--training.steps", str(STEPS)), *CHECKPOINTED)
    a = agent("1:2", port, "elastic", *args)
    b = None
    try:
        wait_until(lambda: logged(tmp_path) == 2, "step 2 on 2 processes", a)
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
    sizes, seams = {m["step"]: m["world_size"] for m in read_metrics(tmp_path)}, resumes(tmp_path)
    assert [size for size, _ in itertools.groupby(r["world_size"] for r in seams)] == [4, 2], seams
    # Growing loses no step (the stopped workers saved the step they were at: 4, or 3 had B come sooner); shrinking
    # redoes the steps after the newest checkpoint (4, saved every 2 steps), and metrics.jsonl drops the 4 processes'
    # records past it: each step once, on the processes whose run goes on.
    grown, shrunk = seams[0]["step"], seams[-1]["step"]
    assert grown in (3, 4) and shrunk == 4, seams
    assert sizes == {s: 4 if grown < s <= shrunk else 2 for s in range(1, 9)}, sizes
    assert sorted(losses(tmp_path)) == sorted(losses(runs["fsdp4"]))
    assert_same_curve(tmp_path, runs["fsdp4"], 1e-5)
