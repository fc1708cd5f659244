"""Replica groups (fault_tolerance.enable, torchft): two torchrun jobs of one process each train one run, and a group
SIGKILLed in the middle of it is restarted by its torchrun while the other trains on alone, then heals from it and
rejoins. The run is the uninterrupted one's: one process's curve, every step logged once."""

import os
import re
import subprocess
import sys

from launch import COMMON, GATE, QUICK_EXIT, ROOT, STEPS, TIMEOUT_S, TRAIN, assert_same_curve, command_env, \
    free_port, kill_tree, torchrun_cmd, train_argv, wait_until

os.environ.setdefault("RUST_LOG", "error")  # before torchft's Rust part reads it: the lighthouse logs each quorum
from torchft._torchft import LighthouseServer  # noqa: E402

from torchtitan_lite.runtime.run_history import read_history

DIES_AT, REJOINS_AT = 4, 6  # group 0, which logs the steps while it lives, dies at the start of step 4


def group(replica: int, folder, lighthouse: str, *gate: str) -> subprocess.Popen:
    args = train_argv(folder, *COMMON, "--training.steps", str(STEPS), "--fault_tolerance.enable",
                      "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", str(replica),
                      "--fault_tolerance.lighthouse", lighthouse, "--fault_tolerance.groups_per_machine", "2")
    cmd, env = torchrun_cmd(1, GATE, str(folder), *gate, *args, launcher=("--standalone", "--max-restarts", "1"))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def restart_after_the_end(folder, lighthouse: str) -> subprocess.CompletedProcess:
    """Group 1's worker as torchrun restarts it (TORCHELASTIC_RESTART_COUNT 1), once the run has ended."""
    args = train_argv(folder, *COMMON, "--training.steps", str(STEPS), "--fault_tolerance.enable",
                      "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "1",
                      "--fault_tolerance.lighthouse", lighthouse)
    env = command_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), TORCHELASTIC_RESTART_COUNT="1",
                      PYTHONPATH=f"{ROOT}{os.pathsep}{QUICK_EXIT}")
    return subprocess.run([sys.executable, str(TRAIN), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_a_killed_group_heals_and_rejoins_while_the_other_trains_on_the_uninterrupted_curve(runs, tmp_path):
    """Group 0 SIGKILLs itself at the start of step 4 (inside the step: group 1 is in its gradient all-reduce), and
    its torchrun starts it again. Group 1 finds the step not committed, trains it again alone once the lighthouse
    has dropped group 0 (1 s without a heartbeat), and step 5; it then waits before step 6's quorum until the
    restarted group 0 asks to join, which heals from it at step 5 and logs the steps again from step 6."""
    # The lighthouse in this process: a Rust server on its own threads, shut down with the test.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, heartbeat_timeout_ms=1000)
    for step in (1, REJOINS_AT):
        (tmp_path / f"hold-q{step}").touch()
    procs = []
    try:
        procs = [group(0, tmp_path, lighthouse.address(), "0", str(DIES_AT)),
                 group(1, tmp_path, lighthouse.address())]
        # Both in the first quorum, however slowly either starts: else one could train past step 4 alone.
        wait_until(lambda: all((tmp_path / f"joining-{r}-0").exists() for r in (0, 1)), "both groups", *procs)
        (tmp_path / "hold-q1").unlink()
        wait_until(lambda: (tmp_path / "joining-0-1").exists(), "group 0's restart", *procs)
        (tmp_path / f"hold-q{REJOINS_AT}").unlink()
        outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
        history = (tmp_path / "metrics.jsonl").read_text()
        late = restart_after_the_end(tmp_path, lighthouse.address())
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
        lighthouse.shutdown()
    for r, out in enumerate(outs):
        (tmp_path / f"group{r}.log").write_text(out)
    restarted, survivor = outs
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    # The survivor lost one step's compute and was never restarted; the dead group came back at its step.
    assert len(re.findall(r"step 4 was not committed \(.+\): training it again", survivor)) == 1, survivor[-3000:]
    assert "was not committed" not in survivor.replace("step 4 was not committed", ""), survivor[-3000:]
    started = [len(re.findall(r"llama3 tiny: [\d.]+M parameters", out)) for out in outs]
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
               for r, out in enumerate(outs)]
    assert len(digests[0]) == len(digests[1]) == 1 and digests[0] == digests[1], digests
    # One history: one start, every step once (group 1 logged 4 and 5), the uninterrupted curve.
    records, resumes = read_history(tmp_path)
    assert [m["step"] for m in records] == list(range(1, STEPS + 1)) and not resumes
    assert sum('"event": "start"' in line for line in (tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    assert_same_curve(tmp_path, runs["single"], 1e-5)
    # A group restarted once the others have finished finds no one to heal from: it says so and trains nothing.
    assert late.returncode == 2 and late.stderr.strip().splitlines()[-1] == (
        "error: replica group 1 restarted and found no live group to heal from (the others have finished, or died "
        "too): without checkpoints there is nothing to rejoin; start the run again"), late.stdout[-2000:] + late.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == history
