"""A rank that stops responding (SIGSTOP) ends the job once its peers' collective timeout runs out, with one line
naming the cause, the option that bounds the wait (comm.train_timeout_seconds, in force after the first step), the
rank that did not join, the collective and the point of the step it stalled (runtime/flight_recorder.py), instead of a
job that hangs forever; each surviving rank writes its flight record to comm_traces/.

The rank stops itself at a named point (stop_at.py): in a 4-rank FSDP job in the forward of a block, before FSDP
all-gathers its weights; in a 2-stage pipeline inside a send or receive, which gloo's flight recorder does not record.
When the stopped rank is rank 0, the one that speaks for the job, the survivor says it after giving rank 0 a training
timeout to speak. That leg runs as the Slurm script does (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), where the store
errors.py talked through lived in rank 0 and a stopped rank 0 held the survivor there forever."""

import os
import pickle
import signal
import subprocess
import time
from pathlib import Path

import pytest
from torch.distributed.flight_recorder import fr_trace

from launch import COMMON, PP2, ROOT, TIMEOUT_S, TINY, descendants, kill_tree, running, torchrun_cmd

STOP_AT = ROOT / "tests" / "multiprocess" / "stop_at.py"
TRAIN_TIMEOUT_S = 3
# Beyond the timeouts the survivors wait out: their start and exit on a loaded 2-core machine, torchrun's reaction.
SLACK_S = 10


def stopped_state(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("nproc, layout, stopped, point, store_env, said", [
    (4, (), 2, "the forward of block 1", {}, "rank 2 did not join all_gather #"),
    (2, PP2, 0, "a pipeline send/receive", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
     "rank 0 did not join a pipeline send/receive, which rank 1 waited on in a pipeline send/receive"),
], ids=["fsdp4-forward", "pp2-rank0-p2p"])
def test_stopped_rank_ends_the_job_naming_it(tmp_path, nproc, layout, stopped, point, store_env, said):
    cmd, env = torchrun_cmd(nproc, STOP_AT, str(stopped), point, "--job.config_file", str(TINY), "--job.dump_folder",
                            str(tmp_path), *COMMON, "--training.steps", "20", "--comm.train_timeout_seconds",
                            str(TRAIN_TIMEOUT_S), *layout)
    env.update(store_env)
    # run_train.sh's file, where the rank that speaks for the job writes its line too: said again after torchrun's
    # failure summary, whose root cause is the first survivor to exit (test_run_train.py)
    env["TORCHTITAN_LITE_ERROR_LOG"] = str(tmp_path / "error_line")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = []
    try:
        deadline = time.monotonic() + TIMEOUT_S  # hang detector, not a timing
        while len(workers) < nproc or not any(running(pid) and stopped_state(pid) for pid in workers):
            assert proc.poll() is None and time.monotonic() < deadline, "no rank ever stopped"
            time.sleep(0.05)
            workers = sorted(descendants(proc.pid))  # spawned in rank order
        stop_time = time.monotonic()
        assert stopped_state(workers[stopped])
        survivors = [pid for rank, pid in enumerate(workers) if rank != stopped]
        # a survivor waits out its collective, the others' posts (half a timeout), and a silent rank 0 (one more)
        bound = TRAIN_TIMEOUT_S * (1.5 + (stopped == 0)) + SLACK_S
        while any(running(pid) for pid in survivors):
            assert time.monotonic() < stop_time + bound, f"a surviving rank was still running after {bound} s"
            time.sleep(0.1)
        os.kill(workers[stopped], signal.SIGKILL)  # what torchrun does to a stopped worker 30 s after its SIGTERM
        out = proc.communicate(timeout=TIMEOUT_S)[0]
    finally:
        for pid in workers:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode != 0
    # rank 1 speaks for a stopped rank 0 in torchrun's failure summary, shown whatever run_train.sh's LOG_RANK
    speaker = "error: " if stopped else "traceback : error: rank 1: "
    lines = [line for line in out.splitlines() if "a collective waited longer than" in line and "error: " in line]
    assert len(lines) == 1 and speaker in lines[0], out[-3000:]
    assert f"comm.train_timeout_seconds = {TRAIN_TIMEOUT_S} s: a peer rank is hung" in lines[0], out[-3000:]
    assert said in lines[0] and point in lines[0], lines[0]
    assert (tmp_path / "error_line").read_text() == lines[0][lines[0].index("error: "):] + "\n"
    # every survivor's flight record, none of the stopped rank's
    traces = Path(tmp_path, "comm_traces")
    assert sorted(p.name for p in traces.iterdir()) == [f"rank_{r}" for r in range(nproc) if r != stopped]
    assert all(pickle.loads(p.read_bytes())["entries"] for p in traces.iterdir())
    # torch's analyzer (`python -m torch.distributed.flight_recorder.fr_trace`) reads them; its main() here, which
    # raises where the command exits non-zero, rather than a process importing torch again for it
    fr_trace.main([str(traces), "--prefix", "rank_", "--allow-incomplete-ranks"])
