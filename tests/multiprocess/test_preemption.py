"""Preemption through ./run_train.sh, as Slurm or Kubernetes deliver it: SIGTERM (or Slurm's SIGUSR1 warning) to
the launch script makes every rank finish the step it is in, save a checkpoint of that step and exit 0; a second
signal while that checkpoint is being written does not spoil it. The second case runs a 2-stage pipeline: both
stages stop after the same step and save it. Ctrl-C, as a terminal sends it (SIGINT to the whole process group), does
the same and exits 130; a second Ctrl-C during that save ends the job at once, leaving the checkpoint before. Before
the first step, Ctrl-C stops the job in one line, whenever it comes."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launch import COMMON, PP2, ROOT, TINY, TIMEOUT_S, descendants, kill_tree, logged, read_metrics, running, wait_until
from torchtitan_lite.checkpoint.folder import complete_checkpoints
from torchtitan_lite.runtime import run_lock


@pytest.mark.parametrize("signals, layout", [(("SIGTERM",), ()), (("SIGUSR1", "SIGTERM"), PP2), (("SIGINT",), ()),
                                             (("SIGINT", "SIGINT"), ())],
                         ids=["SIGTERM", "SIGUSR1_SIGTERM_pp2", "SIGINT", "SIGINT_SIGINT"])
def test_signal_saves_the_current_step(tmp_path, signals, layout):
    ctrl_c_twice = signals == ("SIGINT", "SIGINT")
    env = {**os.environ, "NGPU": "2", "CONFIG_FILE": str(TINY), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "",
           # The second signal lands while the checkpoint is written: its last moment is held open 3 s.
           "TORCHTITAN_LITE_TEST_PAUSE_BEFORE_METADATA_S": "3" if len(signals) > 1 else "0"}
    # Twice Ctrl-C: step 2's checkpoint is the one to keep.
    cmd = ["./run_train.sh", "--job.dump_folder", str(tmp_path), "--training.steps", "1000", "--checkpoint.enable",
           "--checkpoint.interval", "2" if ctrl_c_twice else "500", *layout]
    if signals == ("SIGTERM",):  # held before step 2 while a second run is refused below, rather than train on
        gate = tmp_path / "gate"
        gate.mkdir(parents=True)
        env["SUITE_GATE"] = str(gate)
        (gate / "hold-2").touch()
    # A process group of its own, as a terminal gives a command: Ctrl-C goes to all of it, torchrun included. Ctrl-C
    # at its default, as a terminal's foreground command has it: a suite started in the background (`pytest &`)
    # ignores SIGINT, its children inherit that, and a shell that starts ignoring a signal cannot trap it.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def send(name: str) -> None:
        if name == "SIGINT":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(getattr(signal, name))

    folder = tmp_path / "checkpoint"
    try:
        if signals == ("SIGTERM",):  # a second run into the folder of this live one is refused before it starts
            wait_until(lambda: logged(tmp_path) >= 1, "step 1", proc)  # and waits before step 2 meanwhile (gate.py)
            second = subprocess.Popen(cmd, cwd=ROOT, env={k: v for k, v in env.items() if k != "SUITE_GATE"},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            refusal = second.communicate(timeout=TIMEOUT_S)
            assert second.returncode == 2 and refusal[0] == "", refusal
            assert refusal[1].startswith(f"error: job.dump_folder {tmp_path} is in use by a live run (pid ")
            assert len(refusal[1].splitlines()) == 1, refusal[1]
            (gate / "hold-2").unlink()
        wait_until(lambda: logged(tmp_path) >= 3, "step 3", proc)
        send(signals[0])
        if len(signals) > 1:
            wait_until(lambda: folder.exists() and any(p.suffix == ".tmp" for p in folder.iterdir()), "save", proc)
            saving, workers = next(p for p in folder.iterdir() if p.suffix == ".tmp"), descendants(proc.pid)
            send(signals[1])
        out = proc.communicate(timeout=TIMEOUT_S)[0]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    if ctrl_c_twice:
        # SIGKILLed, they end in a moment: then none can still publish the save it was writing.
        wait_until(lambda: not any(running(p) for p in workers), "the workers' end")
        kept, stopped_at = list(complete_checkpoints(str(folder))), int(saving.stem.removeprefix("step-"))
        assert kept and max(kept) < stopped_at and saving.is_dir(), (kept, saving)
        assert proc.returncode == 130 and out.splitlines()[-1] == (
            f"second Ctrl-C: stopped at once; the newest complete checkpoint is {folder}/step-{max(kept)}"), out[-3000:]
        run_lock.check_free(str(tmp_path))  # the killed run left no lock: the next run into the folder may start
        return
    assert proc.returncode == (130 if signals[0] == "SIGINT" else 0), out[-3000:]
    last = read_metrics(tmp_path)[-1]["step"]
    assert 3 <= last < 1000 and f"{signals[0]}: stopped after step {last}, checkpoint saved" in out
    assert out.count("rerun the same command to resume") == 1 and "Traceback" not in out, out[-3000:]
    # Acknowledged when it came, once, by rank 0: after the step it stopped after, at the latest.
    said = [line for line in out.splitlines() if f"{signals[0]}: stopping after step" in line]
    assert len(said) == 1 and "saving a checkpoint" in said[0], out[-3000:]
    assert last <= int(said[0].split("stopping after step ")[1].split()[0]), said
    assert list(complete_checkpoints(str(folder))) == [last]
    assert not any(p.name.endswith(".tmp") for p in folder.iterdir())


@pytest.mark.parametrize("moment, groups", [("check", 0), ("workers_importing", 0), ("torchruns_starting", 2)],
                         ids=["check", "workers_importing", "replica_groups"])
def test_ctrl_c_during_start_up_stops_before_the_first_step(tmp_path, moment, groups):
    """Ctrl-C while the script checks the config, while the workers import torch (they start with SIGINT ignored, as
    torchrun has it in the background), or while REPLICA_GROUPS' torchruns start, with no worker yet to pass it to:
    the job stops before its first step, in one line (a group's rank 0 each), and exits 130. It used to end in a
    traceback (the check, the groups), or to be lost: the job trained to its end, then exited 130."""
    env = {**os.environ, "NGPU": "1" if groups else "2", "CONFIG_FILE": str(TINY), "PYTHON": sys.executable,
           "CUDA_VISIBLE_DEVICES": "", **({"REPLICA_GROUPS": str(groups)} if groups else {})}
    proc = subprocess.Popen(["./run_train.sh", "--job.dump_folder", str(tmp_path), *COMMON, "--training.steps", "4",
                             "--checkpoint.enable"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def runs(which) -> bool:
        """Whether a process below the script runs whose arguments `which` accepts."""
        found = False
        for pid in descendants(proc.pid):
            with contextlib.suppress(OSError):  # ended meanwhile
                found |= which(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
        return found

    try:
        lines = []
        if moment == "check":
            wait_until(lambda: runs(lambda argv: b"--check" in argv), "the check", proc)
        else:  # the line said as torchrun starts, which takes it seconds (it imports torch)
            while not lines or not lines[-1].startswith("starting "):
                lines.append(proc.stdout.readline())
                assert lines[-1], "".join(lines)
        if moment == "workers_importing":  # as soon as torchrun has started them: they need seconds for torch
            wait_until(lambda: runs(lambda argv: b"train.py" in argv and b"torch.distributed.run" not in argv),
                       "the workers", proc)
        os.killpg(proc.pid, signal.SIGINT)
        out = "".join(lines) + proc.communicate(timeout=TIMEOUT_S)[0]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 130 and out.count(
        "Ctrl-C during start-up: stopped before the first step, nothing saved") == max(groups, 1), out[-3000:]
    assert logged(tmp_path) == 0 and "Traceback" not in out and "failed (exit" not in out, out[-3000:]
