"""Replica groups that lose their place without dying: a writer frozen between its commit and its writes, which must
find the folder taken when it wakes (runtime/fence.py), and a group hung alive in its step, which must leave so that
the others go on (runtime/watchdog.py). Real processes, real signals, real files: `REPLICA_GROUPS=2 ./run_train.sh`."""

import json
import os
import re
import signal

from launch import CHECKPOINTED, assert_same_curve, ckpt, wait_until
from test_replica_groups import assert_same_state, finish, joined, start, steering, workers

from torchtitan_lite.checkpoint.reader import read_metadata
from torchtitan_lite.runtime.run_history import read_history


def assert_every_file_there(folder) -> list[int]:
    """Every complete checkpoint's `.metadata` names files that exist (a resume from it would find every shard); the
    steps of the checkpoints, with nothing else left in the folder (no save in progress, no deletion)."""
    names = sorted(p.name for p in (folder / "checkpoint").iterdir())
    assert all(re.fullmatch(r"step-\d+", n) for n in names), names
    for name in names:
        named = {item.relative_path for item in read_metadata(str(folder / "checkpoint" / name)).storage_data.values()}
        missing = sorted(n for n in named if not (folder / "checkpoint" / name / n).exists())
        assert not missing, f"{name} misses {missing}"
    return sorted(int(n.split("-")[1]) for n in names)


def test_a_frozen_writer_stands_down_and_a_group_hung_alive_leaves(runs, tmp_path):
    """`REPLICA_GROUPS=2 NGPU=1 ./run_train.sh`, 10 steps, checkpoints every 2.
    - Group 0, the writer, is stopped (SIGSTOP) right after it commits step 4, before it logs or saves it. Group 1's
      all-reduce of step 5 times out and it trains on alone, claiming the folder: it logs step 4, which group 0 never
      did, and saves step 5 at once (the newest checkpoint, step 2, is older than step 4, committed and never saved).
      Its save of step 6 is held before its `.metadata` while group 0 is let go: group 0 finds its claim taken and
      stands down in one line, writing neither record 4 nor checkpoint 4 nor sweeping group 1's save in progress (as
      it did before the fence: step-6 was published without its shards, and record 4 was lost). It then heals from
      group 1 (inside its step's attempts), rejoins, first of the groups again, and both train step 7 in the quorum
      it healed in (asking for another, it made group 1's step 7 fail).
    - Group 1 then hangs, alive, in its all-reduce of step 8 (torchft's heartbeat beats on): its watchdog ends it
      after comm.train_timeout_seconds, group 0 trains step 8 alone, and the launcher starts group 1 again, which
      heals and rejoins for step 9 (before the watchdog, group 0 waited for it for good).
    Every checkpoint names only files that exist, every step is logged once, each membership is recorded, both groups
    end with the same state, and the curve is one process's (its 8 steps: the schedule is the same)."""
    folder = tmp_path / "run"
    folder.mkdir()
    for marker in ("hold-q1", "freeze-after-commit-0-4", "hold-save-6", "hang-1-8"):
        (folder / marker).touch()
    proc = start(folder, ["./run_train.sh"], *CHECKPOINTED, "--fault_tolerance.process_group_timeout_ms", "2000",
                 "--comm.train_timeout_seconds", "5", "--training.steps", "10", REPLICA_GROUPS="2", NGPU="1")
    log = folder / "run.log"
    with steering(proc):
        wait_until(lambda: joined(folder, 2), "both groups", proc)
        (folder / "hold-q1").unlink()
        wait_until(lambda: (folder / "frozen-0").exists(), "group 0 stopped after committing step 4", proc)
        frozen = workers(proc, 0)[0]
        wait_until(lambda: (folder / "saving-6").exists(), "group 1 saving step 6 alone", proc)
        assert not ckpt(folder, 4).exists()
        os.kill(frozen, signal.SIGCONT)
        wait_until(lambda: "replica group 0 stands down" in log.read_text(), "group 0 standing down", proc)
        (folder / "hold-save-6").unlink()
        wait_until(lambda: (folder / "hanging-1").exists(), "group 1 hung in step 8", proc)
        (folder / "hold-q9-0").touch()  # group 0 trains step 8 alone, then waits for group 1 to come back
        wait_until(lambda: (folder / "joining-1-1").exists(), "group 1 started again", proc)
        (folder / "hold-q9-0").unlink()
    out, logs = finish(proc, folder, 2)
    assert proc.returncode == 0, out[-4000:]
    assert ("replica group 0 stands down as the run's writer: group 1 took over at step 5 while this one was stopped; "
            "it writes no record or checkpoint until it writes for the run again") in logs[0], logs[0][-3000:]
    # A group healed inside a step's attempts trains the next step in the quorum it healed in (asking for another,
    # the others' step would time out waiting for it): no step fails but the one group 1 hung in.
    assert [re.findall(r"step (\d) was not committed \((.+?)\)", log) for log in logs] == [
        [("8", "Timed out waiting 2000ms for recv operation to complete")], []], logs
    assert "metrics.jsonl: the records of steps 4 written by this job" in logs[1], logs[1][-3000:]
    assert "checkpoint step-5: a catch-up save" in logs[1], logs[1][-3000:]
    assert ("error: replica group 1 made no progress in step 8 up to its all-reduce across the groups "
            "(comm.train_timeout_seconds) for 5 s") in logs[1], logs[1][-3000:]
    assert re.findall(r"replica group (\d) failed \(exit \d+\): starting it again", out) == ["1"], out[-3000:]
    assert re.findall(r"replica groups: (.+); training with (.+)", logs[0]) == [("group 1 left", "0"),
                                                                               ("group 1 joined", "0, 1")], logs[0]
    assert re.findall(r"replica groups: (.+); training with (.+)", logs[1]) == [("group 0 left", "1"),
                                                                               ("group 0 joined", "0, 1")], logs[1]
    assert assert_every_file_there(folder) == [2, 5, 6, 8, 10]
    records, resumes = read_history(folder)
    assert [m["step"] for m in records] == list(range(1, 11)) and not resumes
    assert [m["replica_groups"] for m in records] == [2, 2, 2, 2, 1, 1, 2, 1, 2, 2]
    claims = [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if r.get("event") ==
              "groups"]
    assert [(c["step"], c["writer"], c["trained"], c.get("left"), c.get("joined")) for c in claims] == [
        (1, 0, [0, 1], None, None), (5, 1, [1], [0], None), (7, 0, [0, 1], None, None), (8, 0, [0], [1], None),
        (9, 0, [0, 1], None, [1])]
    assert_same_state(logs, 10)
    assert_same_curve(folder, runs["single"], 1e-5, steps=range(1, 9))

