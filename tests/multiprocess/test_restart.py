"""A worker that dies (SIGKILL: a crash, the OOM killer) is brought back by torchrun with --max-restarts: the new
group forms (it used to fail in gloo's connectFullMesh, see distributed._round_store), resumes from the newest
complete checkpoint and finishes on the uninterrupted curve. The job is a 2-stage pipeline (GPipe): the dead rank holds
the last stage. (An FSDP job that restarts on fewer nodes: test_multinode.py.)"""

import pytest

from run_table import SHARED_RUNS
from launch import COMMON, GATE, STEPS, assert_same_curve, losses, read_metrics, resumes, torchrun
from torchtitan_lite.runtime.run_history import history_run

# pp2_gpipe's curve, made in the background: read last, rather than wait for it among the tests in front.
pytestmark = pytest.mark.reads("shared_2p")


def test_killed_worker_is_restarted_and_finishes_on_the_uninterrupted_curve(runs, tmp_path):
    # Rank 1 dies at the start of step 6; the newest checkpoint is step 4 (saved every 2).
    out = torchrun(2, tmp_path, *COMMON, "--training.steps", str(STEPS), *SHARED_RUNS["pp2_gpipe"].argv,
                   script=GATE, script_args=(str(tmp_path), "1", "6"), launcher=("--standalone", "--max-restarts", "1"))
    output = out.stdout + out.stderr
    assert f"loaded full state from {tmp_path / 'checkpoint' / 'step-4'}" in output
    # The survivors that torchrun stops leave quietly: no traceback from the stage that lost its peer (its error is
    # read through its cause, gloo's reset connection a dead peer's) and no line but rank 0's.
    assert "Traceback" not in output, output[-3000:]
    assert len([line for line in output.splitlines() if "error: " in line]) <= 1, output[-3000:]
    # Step 5, logged before the death, is dropped at the restart: each step once, the resume marked.
    assert [m["step"] for m in read_metrics(tmp_path)] == list(range(1, STEPS + 1))
    # The restarted workers continue the run that saved step 4: one history.
    assert [(r["step"], r["world_size"], r["run"]) for r in resumes(tmp_path)] == [(4, 2, history_run(tmp_path))]
    assert sorted(losses(tmp_path)) == sorted(losses(runs["pp2_gpipe"]))
    assert_same_curve(tmp_path, runs["pp2_gpipe"], 1e-6)
