"""Replica groups (fault_tolerance.enable, torchft), started as users start them: `REPLICA_GROUPS=3 ./run_train.sh`
on one machine, scripts/replica_groups.slurm on a cluster. Groups SIGKILLed, even while serving a heal, or hung, are
started again or let go, heal from a live group and rejoin while the others train on; a signal to one group stops
them all after the same step, with one checkpoint, which a plain run resumes. Through it all the run is the
uninterrupted one's: one process's curve, every step logged once, every group's state the same bit for bit."""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from launch import CHECKPOINTED, COMMON, CP2, GATE, PP2, QUICK_EXIT, ROOT, STEPS, TIMEOUT_S, TINY, TP2, \
    assert_same_curve, ckpt, command_env, descendants, free_port, kill_tree, stopped_after, train_argv, \
    train_in_process, wait_until

os.environ.setdefault("RUST_LOG", "error")  # before torchft's Rust part reads it: the lighthouse logs each quorum
from torchft._torchft import LighthouseServer  # noqa: E402

from torchtitan_lite.runtime.run_history import read_history

# Slurm on one machine: every node is this one, and srun runs its command here, once. A node is down once the test
# has created FAKE_SLURM_DOWN/down-<node>.
FAKE_SLURM = {
    "scontrol": 'if [ "$2" = hostnames ]; then for ((i = 0; i < SLURM_NNODES; i++)); do echo "node$i"; done\n'
                'elif [ -e "$FAKE_SLURM_DOWN/down-$3" ]; then echo "NodeName=$3 State=DOWN*"\n'
                'else echo "NodeName=$3 State=ALLOCATED"; fi\n',
    "srun": 'while [[ $1 == -* ]]; do if [ "$1" = -w ]; then shift; fi; shift; done\n'
            '[ "$1" = hostname ] && { echo 127.0.0.1; exit; }\nexec "$@"\n',
}


def start(folder: Path, program: list[str], *overrides: str, **env: str) -> subprocess.Popen:
    """`program` (run_train.sh, the Slurm script) from the repository with the tests' overrides and `overrides`, its
    workers gated (gate.py; SUITE_GATE may add a death), its output in folder/run.log; the lighthouse drops a group
    silent for 1 s."""
    env = command_env(**{"CONFIG_FILE": str(TINY), "LIGHTHOUSE_HEARTBEAT_MS": "1000", "PYTHON": sys.executable,
                         "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": f"{ROOT}{os.pathsep}{QUICK_EXIT}",
                         "SUITE_GATE": str(folder), **env})
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "run.log", "w") as log:
        return subprocess.Popen([*program, "--job.dump_folder", str(folder), *COMMON, "--training.steps", str(STEPS),
                                 *overrides], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def steering(proc: subprocess.Popen):
    """The test's actions on a running launcher: should one fail, the launcher goes with every process below it."""
    try:
        yield
    except BaseException:
        kill_tree(proc)
        raise


def joined(folder: Path, groups: int) -> bool:
    """Whether every group's first start has asked to join (gate.py's markers)."""
    return all((folder / f"joining-{r}-0").exists() for r in range(groups))


def finish(proc: subprocess.Popen, folder: Path, groups: int) -> tuple[str, list[str]]:
    """Waits for the launcher; (its whole output, each group's rank-0 lines)."""
    try:
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    out = (folder / "run.log").read_text()
    return out, ["\n".join(re.findall(rf"^\[group{g}-rank0\]:(.*)$", out, re.M)) for g in range(groups)]


def assert_same_state(logs: list[str], step: int) -> None:
    """Each group's rank 0 says one digest of its state at `step` (replicas.finish), the same in every group."""
    digests = [re.findall(rf"replica group \d rank 0 ends at step {step}, state digest (\w+)", log) for log in logs]
    assert all(len(d) == 1 for d in digests) and len({d[0] for d in digests}) == 1, digests


def workers(proc: subprocess.Popen, group: int) -> dict[int, int]:
    """Group `group`'s workers below the launcher, rank -> pid: those whose command line says their group."""
    found = {}
    for pid in descendants(proc.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if (b"train.py" in argv and b"torch.distributed.run" not in argv
                and argv[-3:-1] == [b"--fault_tolerance.replica_id", str(group).encode()]):
            env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
            found[int(env[b"RANK"])] = pid
    assert found, f"no worker of group {group}"
    return found


def group_of(pid: int) -> int | None:
    """The replica group of a process of a launcher (its torchrun, or a worker: what their command lines end with)."""
    with contextlib.suppress(OSError):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"train.py" in argv and argv[-3:-2] == [b"--fault_tolerance.replica_id"]:
            return int(argv[-2])
    return None


def lighthouse(proc: subprocess.Popen) -> tuple[int, str] | None:
    """The lighthouse below the launcher `proc`: (its pid, its port), None while there is none."""
    for pid in descendants(proc.pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "--bind" in argv and any("lighthouse" in os.path.basename(a) for a in argv[:2]):
                return pid, argv[argv.index("--bind") + 1].rsplit(":", 1)[1]
    return None


def lighthouse_sees(port: str) -> tuple[int, int]:
    """(groups asking the lighthouse on `port` for the next quorum, groups heartbeating to it), from its status page."""
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as page:
            found = re.search(r"\[(\d+)/\d+ participants healthy\]\[(\d+) heartbeating\]", page.read().decode())
            return int(found[1]), int(found[2])
    return 0, 0


def restart_alone(folder: Path, groups: int, *overrides: str, meanwhile=lambda: None) -> tuple[int, str]:
    """Group 1's worker as the launcher starts it again, alone: the others have ended (a lighthouse of its own).
    `meanwhile` runs once it has asked to join (gated: hold-q markers may hold it there). (Its exit status, output.)"""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, heartbeat_timeout_ms=1000)
    args = train_argv(folder, *COMMON, "--training.steps", str(STEPS), *overrides, "--fault_tolerance.enable",
                      "--fault_tolerance.group_size", str(groups), "--fault_tolerance.replica_id", "1",
                      "--fault_tolerance.lighthouse", lighthouse.address())
    env = command_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), TORCHTITAN_LITE_GROUP_RESTARTS="1",
                      PYTHONPATH=f"{ROOT}{os.pathsep}{QUICK_EXIT}")
    for marker in folder.glob("joining-1-1"):
        marker.unlink()
    proc = subprocess.Popen([sys.executable, str(GATE), str(folder), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: (folder / "joining-1-1").exists(), "the group asking to join", proc)
        meanwhile()
        return proc.wait(timeout=TIMEOUT_S), proc.communicate()[0]
    finally:
        if proc.poll() is None:
            kill_tree(proc)
        lighthouse.shutdown()


def test_three_groups_survive_two_kills_in_a_row_the_second_of_the_group_serving_a_heal(runs, tmp_path):
    """`REPLICA_GROUPS=3 NGPU=1 ./run_train.sh`, a global batch of 8: 4 micro-batches, which 3 groups share 2, 1, 1
    and 2 share 2, 2 (uneven shares; the loss is over the global batch's tokens, so the sum is the batch's gradient).
    Group 0 SIGKILLs itself in step 3's all-reduce across the groups (after its backward) and the launcher starts it
    again; the two others train on. The group asked to send it their state SIGKILLs itself instead, so the heal fails
    and comes from the third group, and the launcher starts the second again, which heals in turn (the others wait
    for it before step 7). The lighthouse is SIGKILLed while that group asks it to join: the launcher starts it again
    on its port, and the three go on with the new one. Torchrun's report of a failed group is left out of the output
    (the launcher's line says it). At the end the three hold the same state, bit for bit, and the run is the
    uninterrupted one's; a group started again once the run has ended has nothing to rejoin, and says so, or with
    fewer groups alive than min_replica_size waits for more a bounded time, and says so."""
    # A collective with a dead group fails at once, or waits this long for it (the survivors' ring, its restart).
    timeout = ("--fault_tolerance.process_group_timeout_ms", "3000")
    folder = tmp_path / "run"
    folder.mkdir()
    for marker in ("hold-q1", "hold-q5", "hold-q7", "die-serving"):
        (folder / marker).touch()
    proc = start(folder, ["./run_train.sh"], *timeout, REPLICA_GROUPS="3", NGPU="1",
                 SUITE_GATE=f"{folder}:0:0:3:reduce")
    with steering(proc):
        wait_until(lambda: joined(folder, 3), "three groups", proc)
        (folder / "hold-q1").unlink()
        wait_until(lambda: (folder / "joining-0-1").exists(), "group 0's restart", proc)
        (folder / "hold-q5").unlink()
        wait_until(lambda: any(folder.glob("died-serving-*")), "the heal's server dying", proc)
        server = int(next(folder.glob("died-serving-*")).name.rsplit("-", 1)[1])
        wait_until(lambda: (folder / f"joining-{server}-1").exists(), "the server's restart", proc)
        # The lighthouse is SIGKILLed while the restarted group asks it to join: the launcher starts another on its
        # port, the group asks that one (torchft retries), and the others too once they heartbeat to it.
        pid, port = lighthouse(proc)
        wait_until(lambda: lighthouse_sees(port)[0] == 1, "the restarted group asking the lighthouse", proc)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: lighthouse(proc) not in (None, (pid, port)), "the lighthouse started again", proc)
        assert lighthouse(proc)[1] == port
        wait_until(lambda: lighthouse_sees(port)[1] == 3, "every group heartbeating to the new lighthouse", proc)
        (folder / "hold-q7").unlink()
    out, logs = finish(proc, folder, 3)
    history = (folder / "metrics.jsonl").read_text()
    assert proc.returncode == 0, out[-4000:]
    assert re.findall(r"^the lighthouse died \(exit -9\): starting it again on port \d+ \(1 of 3 restarts\)$", out,
                      re.M), out[-4000:]
    assert "ChildFailedError" not in out, out[-4000:]  # torchrun's report of a failed group: the line above is ours
    assert server in (1, 2) and len(list(folder.glob("died-serving-*"))) == 1, out[-4000:]
    failed = re.findall(r"^replica group (\d) failed \(exit \d+\): starting it again \(1 of 3 restarts\)$", out, re.M)
    assert failed == ["0", str(server)], out[-4000:]
    # The survivors lost step 3's compute once, and were never started again.
    third = 3 - server
    assert len(re.findall(r"step 3 was not committed \(.+\): training it again", logs[third])) == 1, logs[third]
    assert [log.count("model built, parallelized and initialized") for log in logs] == [
        2 if g in (0, server) else 1 for g in range(3)], out[-4000:]
    assert len(re.findall(r"replica group 0 could not heal \(.+\): asking the groups alive now again", logs[0])) == 1
    healed = [re.findall(rf"replica group {g} healed from a live group in [\d.]+s: step 0 -> (\d)", logs[g])
              for g in (0, server)]
    assert all(len(h) == 1 and 2 <= int(h[0]) <= 6 for h in healed), healed
    assert_same_state(logs, STEPS)
    records, resumes = read_history(folder)
    assert [m["step"] for m in records] == list(range(1, STEPS + 1)) and not resumes
    assert sum('"event": "start"' in line for line in history.splitlines()) == 1
    assert_same_curve(folder, runs["single"], 1e-5)
    code, late = restart_alone(folder, 3, *timeout)
    assert code == 2 and late.strip().splitlines()[-1] == (
        "error: replica group 1 restarted and found no live group to heal from (the others have finished, or died "
        "too): without checkpoints there is nothing to rejoin; start the run again"), late[-2000:]
    assert (folder / "metrics.jsonl").read_text() == history
    # With checkpoints, and min_replica_size 2, no step it trains alone could commit: it waits quorum_timeout_ms for
    # another group, saying so once, then stops in one line (it would train step 1 again and again).
    code, late = restart_alone(folder, 3, *timeout, "--checkpoint.enable", "--fault_tolerance.min_replica_size", "2",
                               "--fault_tolerance.quorum_timeout_ms", "2000")
    short = "1 of 3 replica groups alive, fewer than the 2 a step needs (fault_tolerance.min_replica_size)"
    assert code == 2 and late.strip().splitlines()[-1] == (
        f"error: {short} for 2s (fault_tolerance.quorum_timeout_ms): start the missing groups, or lower "
        "min_replica_size"), late[-2000:]
    assert late.count(short) == 2 and "not committed" not in late, late[-2000:]
    assert (folder / "metrics.jsonl").read_text() == history


def test_on_slurm_groups_outlive_a_hang_and_a_signal_to_one_stops_both_with_one_checkpoint(runs, tmp_path):
    """scripts/replica_groups.slurm on two nodes and a spare (all this machine, srun and scontrol standing in), a
    group of TP 2 on each, resuming FSDP 4's step-4 checkpoint:
    - group 1's node fails as the groups start (Slurm marks it down, its srun ends): the job goes on (--no-kill),
      and the script starts group 1 again on the spare node;
    - group 0 is SIGSTOPped at the start of step 5: group 1's all-reduce with it times out
      (fault_tolerance.process_group_timeout_ms) and, once the lighthouse has missed its heartbeat for a second,
      group 1 trains step 5 alone, says which group is absent, and logs it: the run's history goes on from group 1.
      Let go (SIGCONT), group 0 finds its step failed, heals from group 1 at step 5 (each rank from its counterpart)
      and rejoins, first among the groups again: it logs the steps, and saves them under the run's id. The lighthouse
      is SIGKILLed while group 0 asks it to rejoin: the script starts it again, and group 0 asks the new one;
    - both wait at step 6, and group 1's rank 0 alone gets SIGTERM (the extreme of a signal reaching the groups at
      different moments): step 7's all-reduce tells group 0, and both stop after step 7, which group 0 saves (alone,
      it would train on to step 8).
    One process then resumes step 7 to the end: one history, the uninterrupted curve."""
    bin_dir, folder = tmp_path / "bin", stopped_after(runs["fsdp4"], 4, tmp_path / "run")
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}")
        (bin_dir / name).chmod(0o755)
    for hold in ("hold-q5", "hold-5", "hold-q6", "hold-6"):
        (folder / hold).touch()
    proc = start(folder, ["bash", "scripts/replica_groups.slurm"], *TP2, *CHECKPOINTED,
                 "--fault_tolerance.groups_per_machine", "2", "--fault_tolerance.process_group_timeout_ms", "2000",
                 PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                 SLURM_NNODES="3", SPARE_NODES="1", SLURM_JOB_NODELIST="node[0-2]", SLURM_JOB_ID="1",
                 SLURM_GPUS_PER_NODE="2", FAKE_SLURM_DOWN=str(tmp_path), LIGHTHOUSE_PORT=str(free_port()),
                 RDZV_PORT=str(free_port()), TMPDIR=str(tmp_path))
    log = folder / "run.log"
    with steering(proc):
        wait_until(lambda: joined(folder, 2), "both groups", proc)
        (tmp_path / "down-node1").touch()
        node = [pid for pid in descendants(proc.pid) if group_of(pid) == 1]  # its srun (torchrun here) and workers
        for pid in node:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: (folder / "joining-1-1").exists(), "group 1 started again", proc)
        (folder / "hold-q5").unlink()
        wait_until(lambda: all((folder / f"waiting-{r}-5").exists() for r in (0, 1)), "both at step 5", proc)
        hung = list(workers(proc, 0).values())
        for pid in hung:
            os.kill(pid, signal.SIGSTOP)
        (folder / "hold-5").unlink()
        wait_until(lambda: "replica groups: group 0 absent; training with 1" in log.read_text(), "group 0 dropped",
                   proc)
        asked = (folder / "joining-0-0").stat().st_mtime_ns
        for pid in hung:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: (folder / "joining-0-0").stat().st_mtime_ns > asked, "group 0 asking again", proc)
        pid, port = lighthouse(proc)
        wait_until(lambda: lighthouse_sees(port)[0] == 1, "group 0 asking the lighthouse", proc)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: lighthouse(proc) not in (None, (pid, port)), "the lighthouse started again", proc)
        wait_until(lambda: lighthouse_sees(port)[1] == 2, "both groups heartbeating to the new lighthouse", proc)
        (folder / "hold-q6").unlink()
        wait_until(lambda: all((folder / f"waiting-{r}-6").exists() for r in (0, 1)), "both at step 6", proc)
        os.kill(workers(proc, 1)[0], signal.SIGTERM)
        (folder / "hold-6").unlink()
    out, (first, other) = finish(proc, folder, 2)
    assert proc.returncode == 0, out[-4000:]
    assert re.findall(r"^replica group 1 failed \(exit 137\): node node1 is down, replaced by node2: starting it again "
                      r"\(1 of 3 restarts\)$", out, re.M), out[-4000:]
    assert re.findall(r"^the lighthouse died \(exit 137\): starting it again on port \d+ \(1 of 3 restarts\)$", out,
                      re.M), out[-4000:]
    assert re.findall(r"step (\d) was not committed \((.+?)\)", other) == [
        ("5", "Timed out waiting 2000ms for recv operation to complete")], other[-3000:]
    # Absent from the first step this job commits, the one after the resume.
    assert re.findall(r"replica groups: (.+); training with (.+)", other) == [("group 0 absent", "1"),
                                                                             ("group 0 joined", "0, 1")], other
    assert re.findall(r"replica group 0 healed from a live group in [\d.]+s: step (\d) -> (\d)", first) == [
        ("4", "5")], first[-3000:]
    assert [re.findall(rf"step: {s}/", g) != [] for s in (5, 6) for g in (first, other)] == [False, True, True, False]
    assert "SIGTERM: stopped after step 7, checkpoint saved" in other, other[-3000:]
    assert "a signal to another rank: stopped after step 7, checkpoint saved" in first, first[-3000:]
    assert_same_state([first, other], 7)
    # Saved once, by one group: step 6 (the interval) and 7 (the stop) beside the copied 2 and 4.
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == [f"step-{s}" for s in (2, 4, 6, 7)]
    assert [len(re.findall(rf"saved checkpoint \S+/step-{s} ", g)) for s in (6, 7) for g in (first, other)] \
        == [1, 0, 1, 0]
    train_in_process(folder, *COMMON, "--training.steps", str(STEPS), *CHECKPOINTED)
    records, resumes = read_history(folder)
    assert [m["step"] for m in records] == list(range(1, STEPS + 1))
    assert [r["step"] for r in resumes] == [4, 7]
    assert_same_curve(folder, runs["single"], 1e-5)


def test_in_fast_mode_a_missing_groups_samples_are_skipped_and_named_and_the_rest_is_their_mean(tmp_path):
    """`REPLICA_GROUPS=2 NGPU=2 ... --fault_tolerance.mode fast`, each group 2 pipeline stages, each its own half of
    every global batch of 8, a record every 2 steps. Group 1's last stage SIGKILLs itself at the start of step 1, so
    group 0 trains step 1 alone: its loss and gradient norm are those of a global batch of its 4 windows alone (the
    sums scaled to their mean; unscaled, both would be halved). Group 1 is started again, resumes step 4 and heals
    from group 0 (step 5, trained alone: its skipped windows travel with the state) before step 6, which both train.
    Group 0, the writer, then dies right after it commits step 6, before it logs it: group 1 holds the record, sends
    it with its state when group 0 comes back and heals from it, and group 0 writes it, naming the windows of step 5
    (lost before: a healed group dropped them, and a dead writer's record was nobody's). Every record names the
    windows skipped since the one before, and no other window is missing or trained twice. At the end each stage's
    state is the same in both groups, bit for bit. Groups of CP 2 then resume its step-7 checkpoint (a catch-up save:
    step 6 was never saved) and train step 8 as it did; a group started alone from an older one while another logs
    past it stops."""
    half, folder = tmp_path / "half", tmp_path / "run"
    train_in_process(half, *COMMON, "--training.steps", str(STEPS), "--training.global_batch_size", "4")
    folder.mkdir()
    for marker in ("hold-q1", "hold-q6-0", "kill-after-commit-0-6", "hold-q7-1"):
        (folder / marker).touch()
    proc = start(folder, ["./run_train.sh"], *PP2, "--training.local_batch_size", "4", *CHECKPOINTED,
                 "--fault_tolerance.mode", "fast", "--fault_tolerance.process_group_timeout_ms", "3000",
                 "--metrics.log_freq", "2", REPLICA_GROUPS="2", NGPU="2", LOG_RANK="0,1",
                 SUITE_GATE=f"{folder}:1:1:1")
    with steering(proc):
        wait_until(lambda: joined(folder, 2), "two groups", proc)
        (folder / "hold-q1").unlink()
        wait_until(lambda: (folder / "joining-1-1").exists(), "group 1's restart", proc)
        (folder / "hold-q6-0").unlink()
        wait_until(lambda: (folder / "joining-0-1").exists(), "group 0's restart", proc)
        (folder / "hold-q7-1").unlink()
    out, logs = finish(proc, folder, 2)
    assert proc.returncode == 0, out[-4000:]
    assert not list(folder.glob("comm_traces/rank__quorum_*")), "torchft's folders per quorum, empty: flight_recorder"
    assert "each in each of the 2 replica groups; a missing group's are skipped: fault_tolerance.mode fast" in out
    assert re.findall(r"replica group (\d) failed \(exit \d+\): starting it again", out) == ["1", "0"], out[-3000:]
    assert re.findall(r"replica group 1 healed from a live group in [\d.]+s: step (\d) -> (\d)", logs[1]) == [
        ("4", "5")], logs[1][-3000:]
    assert re.findall(r"replica group 0 healed from a live group in [\d.]+s: step (\d) -> (\d)", logs[0]) == [
        ("4", "6")], logs[0][-3000:]
    assert "metrics.jsonl: the records of steps 6 written by this job" in logs[0], logs[0][-3000:]
    assert "checkpoint step-7: a catch-up save" in logs[0], logs[0][-3000:]
    assert re.findall(r"replica groups: (.+); training with (.+)", logs[0]) == [
        ("group 1 absent", "0 (fast mode: a missing group's samples are skipped)"), ("group 1 joined", "0, 1")]
    records = read_history(folder)[0]
    assert [m["step"] for m in records] == [1, 2, 4, 6, 8]
    assert [m["skipped_samples"] for m in records] == [[[4, 8]], [[12, 16]], [[20, 24], [28, 32]], [[36, 40]], []]
    assert [m["replica_groups"] for m in records] == [1, 1, 1, 2, 2]
    assert_same_curve(folder, half, 1e-5, steps=[1])
    found = re.findall(rf"^\[group(\d)-rank(\d)\]:.* ends at step {STEPS}, state digest (\w+)", out, re.M)
    digests = {(g, r): d for g, r, d in found}
    assert len(found) == len(digests) == 4 and all(digests["0", r] == digests["1", r] for r in "01"), found
    # As if the run had stopped after step 7: groups of CP 2 resume its checkpoint, in exact mode, and train step 8 as
    # it did (every group was alive then, so both modes train the whole batch).
    fast = tmp_path / "fast"
    fast.mkdir()
    shutil.copy(folder / "metrics.jsonl", fast)
    shutil.rmtree(ckpt(folder, 8))
    for marker in folder.glob("joining-*"):
        marker.unlink()
    (folder / "hold-q8").touch()  # until both ask: the first to ask would otherwise train on alone
    proc = start(folder, ["./run_train.sh"], *CP2, "--training.local_batch_size", "4", *CHECKPOINTED,
                 "--metrics.log_freq", "2", REPLICA_GROUPS="2", NGPU="2")
    with steering(proc):
        wait_until(lambda: joined(folder, 2), "two groups", proc)
        (folder / "hold-q8").unlink()
    out, logs = finish(proc, folder, 2)
    assert proc.returncode == 0, out[-4000:]
    assert_same_state(logs, STEPS)
    records, resumes = read_history(folder)
    assert [m["step"] for m in records] == [1, 2, 4, 6, 8] and [r["step"] for r in resumes] == [7]
    assert_same_curve(folder, fast, 1e-5, steps=[8])
    # A group restarted alone from the step-4 checkpoint while another logged steps past it (a claim appended to the
    # file once it has started) is behind a run that went on without it: it stops, and the history is left as it was.
    for step in (7, 8):
        shutil.rmtree(ckpt(folder, step))
    metrics, claim = folder / "metrics.jsonl", '{"event": "groups", "step": 9, "writer": 0, "token": "g0q9"}\n'
    history = metrics.read_text()
    (folder / "hold-q5").touch()

    def another_group_logs():
        with open(metrics, "a") as f:
            f.write(claim)
        (folder / "hold-q5").unlink()

    code, late = restart_alone(folder, 2, "--training.local_batch_size", "4", *CHECKPOINTED,
                               meanwhile=another_group_logs)
    assert code == 2 and late.strip().splitlines()[-1] == (
        "error: replica group 1 is behind the run: another group logged steps past 4 since this one started, and "
        "none is alive to heal from (they have finished, or died): nothing to rejoin"), late[-2000:]
    assert metrics.read_text() == history + claim and not ckpt(folder, 6).exists()
