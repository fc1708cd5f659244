"""Replica groups (fault_tolerance.enable, torchft), as users start them: `REPLICA_GROUPS=2 NGPU=1 ./run_train.sh`,
two torchrun jobs of one process each training one run. A group SIGKILLed in the middle of it is started again by
the launcher while the other trains on alone, heals from it and rejoins; a signal to one group stops both after the
same step, with one checkpoint, which a plain run resumes. The run is the uninterrupted one's: one process's curve,
every step logged once."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from launch import CHECKPOINTED, COMMON, QUICK_EXIT, ROOT, STEPS, TIMEOUT_S, TINY, TP2, TRAIN, assert_same_curve, \
    ckpt, command_env, descendants, free_port, kill_tree, run_job, stopped_after, torchrun, train_argv, wait_until

os.environ.setdefault("RUST_LOG", "error")  # before torchft's Rust part reads it: the lighthouse logs each quorum
from torchft._torchft import LighthouseServer  # noqa: E402

from torchtitan_lite.runtime.run_history import read_history

DIES_AT, REJOINS_AT = 4, 6  # group 0, which logs the steps while it lives, dies at the start of step 4
GROUPS = ("--fault_tolerance.enable", "--fault_tolerance.group_size", "2")


def start_groups(folder: Path, *overrides: str, die: str = "", nproc: int = 1,
                 groups: int = 2) -> subprocess.Popen:
    """`REPLICA_GROUPS=groups NGPU=nproc ./run_train.sh` on the tests' model, its workers gated (gate.py: `die` is
    REPLICA:RANK:STEP[:reduce]), its output in folder/run.log; the lighthouse drops a group silent for 1 s."""
    env = command_env(REPLICA_GROUPS=str(groups), NGPU=str(nproc), CONFIG_FILE=str(TINY),
                      LIGHTHOUSE_HEARTBEAT_MS="1000", PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="",
                      PYTHONPATH=f"{ROOT}{os.pathsep}{QUICK_EXIT}",
                      SUITE_GATE=f"{folder}{':' + die if die else ''}")
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "run.log", "w") as log:
        return subprocess.Popen(["./run_train.sh", "--job.dump_folder", str(folder), *COMMON, "--training.steps",
                                 str(STEPS), *overrides], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, folder: Path, groups: int = 2) -> tuple[str, list[str]]:
    """Waits for the launcher; (its whole output, each group's rank-0 lines)."""
    try:
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    out = (folder / "run.log").read_text()
    return out, ["\n".join(re.findall(rf"^\[group{g}-rank0\]:(.*)$", out, re.M)) for g in range(groups)]


def worker(proc: subprocess.Popen, group: int) -> int:
    """The pid of group `group`'s rank 0: the worker below the launcher whose command line says its group."""
    for pid in descendants(proc.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if (b"train.py" in argv and b"torch.distributed.run" not in argv
                and argv[-3:-1] == [b"--fault_tolerance.replica_id", str(group).encode()]
                and b"RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")):
            return pid
    raise AssertionError(f"no worker of group {group}")


def restart_after_the_end(folder) -> subprocess.CompletedProcess:
    """Group 1's worker as the launcher starts it again, once the run has ended (a lighthouse of its own)."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, heartbeat_timeout_ms=1000)
    args = train_argv(folder, *COMMON, "--training.steps", str(STEPS), *GROUPS, "--fault_tolerance.replica_id", "1",
                      "--fault_tolerance.lighthouse", lighthouse.address())
    env = command_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), TORCHTITAN_LITE_GROUP_RESTARTS="1",
                      PYTHONPATH=f"{ROOT}{os.pathsep}{QUICK_EXIT}")
    try:
        return subprocess.run([sys.executable, str(TRAIN), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    finally:
        lighthouse.shutdown()


def test_a_killed_group_heals_and_rejoins_while_the_other_trains_on_the_uninterrupted_curve(runs, tmp_path):
    """Group 0 SIGKILLs itself at the start of step 4 (inside the step: group 1 is in its gradient all-reduce), and
    the launcher starts it again. Group 1 finds the step not committed, trains it again alone once the lighthouse
    has dropped group 0 (1 s without a heartbeat), and step 5; it then waits before step 6's quorum until the
    restarted group 0 asks to join, which heals from it at step 5 and logs the steps again from step 6."""
    for step in (1, REJOINS_AT):
        (tmp_path / f"hold-q{step}").touch()
    proc = start_groups(tmp_path, die=f"0:0:{DIES_AT}")
    try:
        # Both in the first quorum, however slowly either starts: else one could train past step 4 alone.
        wait_until(lambda: all((tmp_path / f"joining-{r}-0").exists() for r in (0, 1)), "both groups", proc)
        (tmp_path / "hold-q1").unlink()
        wait_until(lambda: (tmp_path / "joining-0-1").exists(), "group 0's restart", proc)
        (tmp_path / f"hold-q{REJOINS_AT}").unlink()
    except BaseException:
        kill_tree(proc)
        raise
    out, (restarted, survivor) = finish(proc, tmp_path)
    history = (tmp_path / "metrics.jsonl").read_text()
    assert proc.returncode == 0, out[-4000:]
    assert re.findall(r"^replica group (\d) failed \(exit \d+\): starting it again \(1 of 3 restarts\)$", out,
                      re.M) == ["0"], out[-4000:]
    # The survivor lost one step's compute and was never restarted; the dead group came back at its step.
    assert len(re.findall(r"step 4 was not committed \(.+\): training it again", survivor)) == 1, survivor[-3000:]
    assert "was not committed" not in survivor.replace("step 4 was not committed", ""), survivor[-3000:]
    started = [out.count("model built, parallelized and initialized") for out in (restarted, survivor)]
    assert started == [2, 1], started
    # At step 5, once let in; at 3 or 4 had its restart beaten the lighthouse's second without its heartbeat.
    healed = re.findall(r"replica group 0 healed from a live group in [\d.]+s: step 0 -> (\d+)", restarted)
    assert len(healed) == 1 and DIES_AT - 1 <= int(healed[0]) <= REJOINS_AT - 1, restarted[-3000:]
    # The survivor names the group that left and came back, once it has committed a step without it.
    changes = re.findall(r"replica groups: (.+); training with (.+)", survivor)
    alone = int(healed[0]) >= DIES_AT
    assert changes == [("group 0 left", "1"), ("group 0 joined", "0, 1")] * alone, changes
    # Weights and optimizer state, bit for bit, in both groups at the end.
    digests = [re.findall(rf"replica group {r} rank 0 ends at step {STEPS}, state digest (\w+)", out)
               for r, out in enumerate((restarted, survivor))]
    assert len(digests[0]) == len(digests[1]) == 1 and digests[0] == digests[1], digests
    # One history: one start, every step once (group 1 logged 4 and 5), the uninterrupted curve.
    records, resumes = read_history(tmp_path)
    assert [m["step"] for m in records] == list(range(1, STEPS + 1)) and not resumes
    assert sum('"event": "start"' in line for line in history.splitlines()) == 1
    assert_same_curve(tmp_path, runs["single"], 1e-5)
    # A group restarted once the others have finished finds no one to heal from: it says so and trains nothing.
    late = restart_after_the_end(tmp_path)
    assert late.returncode == 2 and late.stderr.strip().splitlines()[-1] == (
        "error: replica group 1 restarted and found no live group to heal from (the others have finished, or died "
        "too): without checkpoints there is nothing to rejoin; start the run again"), late.stdout[-2000:] + late.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == history


def test_a_signal_to_one_group_stops_both_with_one_checkpoint_that_a_plain_run_resumes(runs, tmp_path):
    """The groups, TP 2 each, resume FSDP 4's step-4 checkpoint. Both wait at step 6, and group 1's rank 0 alone gets
    SIGTERM (the extreme of a signal reaching the groups at different moments): the step's all-reduce tells group 0,
    and both stop after step 7, which the group that logs saves (alone it would train on to step 8). One process then
    resumes step 7 to the end: one history, the uninterrupted curve."""
    folder = stopped_after(runs["fsdp4"], 4, tmp_path / "run")
    for hold in ("hold-q5", "hold-6"):
        (folder / hold).touch()
    proc = start_groups(folder, *CHECKPOINTED, *TP2, nproc=2)
    try:
        wait_until(lambda: all((folder / f"joining-{r}-0").exists() for r in (0, 1)), "both groups", proc)
        (folder / "hold-q5").unlink()
        wait_until(lambda: all((folder / f"waiting-{r}-6").exists() for r in (0, 1)), "both groups at step 6", proc)
        os.kill(worker(proc, 1), signal.SIGTERM)
        (folder / "hold-6").unlink()
    except BaseException:
        kill_tree(proc)
        raise
    out, (writer, signalled) = finish(proc, folder)
    assert proc.returncode == 0, out[-4000:]
    assert "SIGTERM: stopped after step 7, checkpoint saved" in signalled, signalled[-3000:]
    assert "a signal to another rank: stopped after step 7, checkpoint saved" in writer, writer[-3000:]
    digests = [re.findall(r"replica group \d rank 0 ends at step 7, state digest (\w+)", g)
               for g in (writer, signalled)]
    assert len(digests[0]) == 1 and digests[0] == digests[1], digests
    # Saved once, by one group: step 6 (the interval) and 7 (the stop) beside the copied 2 and 4.
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == [f"step-{s}" for s in (2, 4, 6, 7)]
    assert [len(re.findall(rf"saved checkpoint \S+/step-{s} ", g)) for s in (6, 7) for g in (writer, signalled)] \
        == [1, 0, 1, 0]
    torchrun(1, folder, *COMMON, "--training.steps", str(STEPS), *CHECKPOINTED)
    records, resumes = read_history(folder)
    assert [m["step"] for m in records] == list(range(1, STEPS + 1))
    assert [r["step"] for r in resumes] == [4, 7]
    assert_same_curve(folder, runs["single"], 1e-5)
    assert ckpt(folder, STEPS).is_dir()


def test_three_groups_survive_two_kills_in_a_row_the_second_of_the_group_serving_a_heal(tmp_path):
    """Three groups (a global batch of 12: whole micro-batches for 1, 2 or 3 of them). Group 0 SIGKILLs itself in
    step 3's all-reduce across the groups (after its backward) and the launcher starts it again; the two others train
    on, then wait before step 5 until it
    asks to join. The group asked to send it their state SIGKILLs itself instead, so the heal fails: group 0 heals
    from the third group, and the second restarts and heals in turn. At the end the three hold the same state, bit
    for bit, and the run is the uninterrupted one's."""
    # A collective with a dead group fails at once, or waits this long for it (the survivors' ring, its restart).
    batch12 = ("--training.global_batch_size", "12", "--fault_tolerance.process_group_timeout_ms", "3000")
    reference, folder = tmp_path / "single", tmp_path / "run"
    torchrun(1, reference, *COMMON, "--training.steps", str(STEPS), *batch12)
    folder.mkdir()
    for marker in ("hold-q1", "hold-q5", "die-serving"):
        (folder / marker).touch()
    proc = start_groups(folder, *batch12, die="0:0:3:reduce", groups=3)
    try:
        wait_until(lambda: all((folder / f"joining-{r}-0").exists() for r in range(3)), "three groups", proc)
        (folder / "hold-q1").unlink()
        wait_until(lambda: (folder / "joining-0-1").exists(), "group 0's restart", proc)
        (folder / "hold-q5").unlink()
    except BaseException:
        kill_tree(proc)
        raise
    out, logs = finish(proc, folder, groups=3)
    assert proc.returncode == 0, out[-4000:]
    servers = [int(p.name.rsplit("-", 1)[1]) for p in folder.glob("died-serving-*")]
    assert len(servers) == 1 and servers[0] in (1, 2), out[-4000:]
    failed = re.findall(r"^replica group (\d) failed \(exit \d+\): starting it again \(1 of 3 restarts\)$", out, re.M)
    assert failed == ["0", str(servers[0])], out[-4000:]
    digests = [re.findall(rf"replica group {g} rank 0 ends at step {STEPS}, state digest (\w+)", log)
               for g, log in enumerate(logs)]
    assert all(len(d) == 1 for d in digests) and len({d[0] for d in digests}) == 1, digests
    records, resumes = read_history(folder)
    assert [m["step"] for m in records] == list(range(1, STEPS + 1)) and not resumes
    assert_same_curve(folder, reference, 1e-5)


# Slurm on one machine: every node is this one, and srun runs its command here, once.
FAKE_SLURM = {
    "scontrol": 'printf "node0\\nnode1\\n"\n',
    "srun": 'while [[ $1 == -* ]]; do if [ "$1" = -w ]; then shift; fi; shift; done\n'
            '[ "$1" = hostname ] && { echo 127.0.0.1; exit; }\nexec "$@"\n',
}


def test_the_slurm_script_trains_one_run_as_a_group_per_node(runs, tmp_path):
    """scripts/replica_groups.slurm on an allocation of two nodes (both this machine), 1 process each: the lighthouse
    it starts, a torchrun per group, one history on the uninterrupted curve."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}")
        (bin_dir / name).chmod(0o755)
    folder = tmp_path / "run"
    env = command_env(PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                      SLURM_NNODES="2", SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_ID="1", SLURM_GPUS_PER_NODE="1",
                      CONFIG_FILE=str(TINY), LIGHTHOUSE_PORT=str(free_port()), RDZV_PORT=str(free_port()),
                      PYTHON=sys.executable, RUST_LOG="error", CUDA_VISIBLE_DEVICES="",
                      PYTHONPATH=f"{ROOT}{os.pathsep}{QUICK_EXIT}", TMPDIR=str(tmp_path))
    proc = run_job(["bash", "scripts/replica_groups.slurm", "--job.dump_folder", str(folder), *COMMON,
                    "--training.steps", str(STEPS), "--fault_tolerance.groups_per_machine", "2"], env)
    out = proc.stdout + proc.stderr
    digests = [re.findall(rf"\[group{g}-rank0\]:.*ends at step {STEPS}, state digest (\w+)", out) for g in (0, 1)]
    assert len(digests[0]) == 1 and digests[0] == digests[1], out[-3000:]
    assert [m["step"] for m in read_history(folder)[0]] == list(range(1, STEPS + 1))
    assert_same_curve(folder, runs["single"], 1e-5)
