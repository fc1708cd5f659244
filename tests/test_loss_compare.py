"""scripts/loss_compare.py, run as users run it: a subprocess on real metrics.jsonl files."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import train
from tests.multiprocess.launch import assert_same_curve, train_in_process

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "loss_compare.py"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
LOSSES = [10.83710384368896, 10.5012345678, 9.87654321, 9.1234567891, 8.765432109]


def write_metrics(path: Path, losses, steps=None, extra_lines=(), grad_norm=1.5) -> Path:
    """A metrics.jsonl shaped like the trainer's: one object per step, all contract keys, full-precision floats."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for step, loss in zip(steps or range(1, len(losses) + 1), losses):
        record = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": 8e-4, "tps": 1234.5, "mfu": 0.1,
                  "memory_gib": 0.5, "elapsed_s": 0.1 * step}
        lines.append(json.dumps(record))
    lines.extend(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def run(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env)


def test_identical_curves_pass_with_zero_difference(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    b = write_metrics(tmp_path / "b.jsonl", LOSSES)
    r = run(a, b, "--tolerance", 0)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "max abs diff: 0.000e+00" in r.stdout
    assert "max rel diff: 0.000e+00" in r.stdout


def test_difference_above_tolerance_fails_and_names_the_step(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    b = write_metrics(tmp_path / "b.jsonl", [x + (1e-3 if i == 2 else 0) for i, x in enumerate(LOSSES)])
    r = run(a, b)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "max abs diff: 1.000e-03 at step 3" in r.stdout
    assert "FAIL" in r.stdout


def test_difference_within_tolerance_passes(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    b = write_metrics(tmp_path / "b.jsonl", [x + 1e-6 for x in LOSSES])
    assert run(a, b).returncode == 0  # default tolerance 1e-5
    assert run(a, b, "--tolerance", 0).returncode == 1


def test_dump_folder_input_and_validation_lines_are_ignored(tmp_path):
    # A record with val_loss and no loss (a validation step between logged steps): not on the loss curve.
    val = json.dumps({"step": 6, "val_loss": 9.0})
    write_metrics(tmp_path / "run_a" / "metrics.jsonl", LOSSES, extra_lines=[val])
    write_metrics(tmp_path / "run_b" / "metrics.jsonl", LOSSES)
    r = run(tmp_path / "run_a", tmp_path / "run_b", "--tolerance", 0)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "only in" not in r.stdout


def test_after_a_resume_record_the_resumed_run_s_records_win(tmp_path):
    # The run logged steps 1-4 with a bad loss at 3 and 4, then resumed from step 2 and re-logged 3-5: a file joined
    # by hand (the trainer itself cuts the records past the checkpoint).
    first = write_metrics(tmp_path / "first.jsonl", [LOSSES[0], LOSSES[1], 99.0, 99.0])
    resumed = [line for line in write_metrics(tmp_path / "r.jsonl", LOSSES).read_text().splitlines()[2:]]
    a = tmp_path / "a" / "metrics.jsonl"
    a.parent.mkdir()
    resume = json.dumps({"event": "resume", "step": 2, "world_size": 4})
    a.write_text(first.read_text() + "\n".join([resume, *resumed]) + "\n")
    b = write_metrics(tmp_path / "b.jsonl", LOSSES)
    r = run(a, b, "--tolerance", 0)
    assert r.returncode == 0, r.stdout + r.stderr


def test_two_runs_spliced_in_one_file_are_an_input_error(tmp_path):
    # A rerun that appended to an earlier run's file (as run_train.sh did before the earlier run was moved aside).
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    spliced = write_metrics(tmp_path / "b.jsonl", LOSSES[:3], extra_lines=write_metrics(
        tmp_path / "rerun.jsonl", LOSSES[:2]).read_text().splitlines())
    r = run(a, spliced)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert r.stderr.startswith(f"error: {spliced}:4: step 1 after step 3 with no resume record between")


def test_steps_in_one_run_only_are_warned_about_not_compared(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    b = write_metrics(tmp_path / "b.jsonl", LOSSES[:3] + [0.0, 0.0, 0.0], steps=[1, 2, 3, 4, 5, 6])
    r = run(a, b, "--steps", 3, "--tolerance", 0)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(a, b)
    assert r.returncode == 1  # steps 4 and 5 differ
    assert "steps only in B, not compared: 6" in r.stdout


def test_missing_file_is_an_input_error(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    r = run(a, tmp_path / "nope")
    assert r.returncode == 2
    assert "nope" in r.stderr and "no such file" in r.stderr


def test_malformed_json_line_names_file_and_line(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    b = write_metrics(tmp_path / "b.jsonl", LOSSES[:2], extra_lines=['{"step": 3, "loss": 9.8'])
    r = run(a, b)
    assert r.returncode == 2
    assert f"{b}:3:" in r.stderr


def test_no_common_step_is_an_input_error(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES[:2])
    b = write_metrics(tmp_path / "b.jsonl", LOSSES[:2], steps=[10, 11])
    r = run(a, b)
    assert r.returncode == 2
    assert "no step" in r.stderr


def test_nan_on_one_side_fails(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    b = write_metrics(tmp_path / "b.jsonl", LOSSES[:4] + [float("nan")])
    r = run(a, b, "--tolerance", 1e9)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "at step 5" in r.stdout


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path):
    hidden = tmp_path / "hidden" / "matplotlib"  # a package that shadows an installed matplotlib and fails to import
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    r = run(a, a, "--plot", tmp_path / "out.png", env={**os.environ, "PYTHONPATH": str(hidden.parent)})
    assert r.returncode == 2
    assert "--plot needs matplotlib: pip install matplotlib" in r.stderr
    assert not (tmp_path / "out.png").exists()


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plot_writes_png(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    r = run(a, a, "--plot", tmp_path / "out.png")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- The grad norm: the loss curve's blind spot


def test_grad_norm_difference_fails_and_is_named_while_the_loss_agrees(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    b = write_metrics(tmp_path / "b.jsonl", LOSSES, grad_norm=1.5 * (1 + 1e-4))
    r = run(a, b)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "loss: OK" in r.stdout and "grad_norm: FAIL" in r.stdout
    assert r.stdout.splitlines()[-1] == "FAIL: grad_norm differs from step 1"
    assert run(a, b, "--grad_norm_tolerance", 1e-3).returncode == 0  # relative: 1e-4 of 1.5 is within 1e-3
    assert run(a, b, "--no_grad_norm").returncode == 0


def test_both_metrics_differing_are_both_named_with_their_first_step(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    b = write_metrics(tmp_path / "b.jsonl", [x + (1e-3 if i >= 3 else 0) for i, x in enumerate(LOSSES)], grad_norm=3.0)
    r = run(a, b)
    assert r.returncode == 1
    assert r.stdout.splitlines()[-1] == "FAIL: loss and grad_norm differ (loss from step 4, grad_norm from step 1)"


def test_tolerance_zero_is_bitwise_for_the_grad_norm_too(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    b = write_metrics(tmp_path / "b.jsonl", LOSSES, grad_norm=1.5 + 2e-16)  # the next float64 after 1.5
    assert run(a, b).returncode == 0
    r = run(a, b, "--tolerance", 0)
    assert r.returncode == 1 and "grad_norm: FAIL" in r.stdout


def test_metrics_without_grad_norm_are_compared_on_the_loss_and_say_so(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({"step": s, "loss": x}) + "\n" for s, x in enumerate(LOSSES, 1)))
    r = run(a, old, "--tolerance", 0)
    assert r.returncode == 0, r.stdout + r.stderr
    notes = [line for line in r.stdout.splitlines() if "grad_norm" in line]
    assert notes == ["note: grad_norm not compared (run B logged none): loss alone decides"]


def test_negative_grad_norm_tolerance_is_an_input_error(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", LOSSES)
    r = run(a, a, "--grad_norm_tolerance", -1)
    assert r.returncode == 2 and "--grad_norm_tolerance must be a number >= 0" in r.stderr


@pytest.mark.parametrize("max_norm", ["0", "1.0"])
def test_gradients_doubled_on_one_run_fail_on_the_grad_norm_alone(tmp_path, monkeypatch, max_norm):
    """What a reduction that forgot its 1/dp looks like (every gradient x2 before clipping), in two real 3-step
    trainings: AdamW cancels the constant factor but for its eps (unclipped, the curves drift apart slowly: a longer
    run ends up above the parity tolerance), and with clipping on the clip rescales both runs to the same norm, so the
    loss curves agree within the parity tolerance while the grad norm doubles."""
    overrides = ("--training.steps", "3", "--training.max_norm", max_norm)
    train_in_process(tmp_path / "a", *overrides)
    clip = train.clip_grad_norm_

    def doubled_then_clipped(params, *args, **kwargs):
        for p in params:
            if p.grad is not None:
                p.grad.mul_(2)
        return clip(params, *args, **kwargs)

    monkeypatch.setattr(train, "clip_grad_norm_", doubled_then_clipped)
    train_in_process(tmp_path / "b", *overrides)
    r = run(tmp_path / "a", tmp_path / "b", "--tolerance", 1e-5)  # the README's parity check
    assert r.returncode == 1, r.stdout + r.stderr
    assert "loss: OK" in r.stdout, r.stdout  # the blind spot: the loss alone would pass
    assert r.stdout.splitlines()[-1] == "FAIL: grad_norm differs from step 1", r.stdout
    assert "grad_norm max rel diff: 1.000e+00" in r.stdout  # B's norm is twice A's at every step
    with pytest.raises(AssertionError, match="grad_norm differs by 1.00e"):  # and so does the suite's parity check
        assert_same_curve(tmp_path / "b", tmp_path / "a", 1e-5)


# ---- Training both runs first: each shows its progress while it trains

FAKE_RUN = '''#!{python}
"""Stands in for run_train.sh: writes config.toml and three steps' records as the trainer does, and after step 1
waits for the test to have seen that step's progress line (as long as a real step takes), failing after 20 s."""
import json, os, sys, time
from pathlib import Path
dump = Path(sys.argv[sys.argv.index("--job.dump_folder") + 1])
(dump / "config.toml").write_text("[training]\\nsteps = 3\\n")
go = Path(os.environ["FAKE_GO"]) / dump.name
with open(dump / "metrics.jsonl", "a") as f:
    for step, loss in enumerate({losses}, 1):
        f.write(json.dumps({{"step": step, "loss": loss, "grad_norm": 1.5, "tps": 1234.5, "elapsed_s": 0.5 * step}}))
        f.write("\\n")
        f.flush()
        waited = 0.0
        while step == 1 and not go.exists():
            time.sleep(0.05)
            waited += 0.05
            if waited > 20:
                sys.exit("no progress line seen for step 1")
'''


def test_runs_trained_first_show_each_logged_step_on_stderr_while_they_train(tmp_path):
    """A copy of the script beside a stand-in for run_train.sh. Each run's step 1 must be reported while the run is
    still going (the stand-in waits for the line before it writes step 2); stdout is the comparison, unchanged."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "loss_compare.py")
    fake = repo / "run_train.sh"
    fake.write_text(FAKE_RUN.format(python=sys.executable, losses=LOSSES[:3]))
    fake.chmod(0o755)
    go = tmp_path / "go"
    go.mkdir()
    work = tmp_path / "work"
    command = [sys.executable, str(repo / "scripts" / "loss_compare.py"), "--run_a", "--training.steps 3",
               "--run_b", "--training.steps 3", "--workdir", str(work), "--tolerance", "0"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "FAKE_GO": str(go)}) as proc:
        progress = []
        for line in proc.stderr:
            progress.append(line.rstrip("\n"))
            if line.startswith(("run_a: step: 1/3", "run_b: step: 1/3")):
                (go / line[4]).touch()  # the run may go on
        out = proc.stdout.read()
    assert proc.returncode == 0, out + "\n".join(progress)
    expected = [f"run_{name}: step: {step}/3  loss: {loss:.4f}  grad_norm: 1.5000  tps: 1,234  elapsed_s: "
                f"{0.5 * step:.1f}" for name in "ab" for step, loss in enumerate(LOSSES[:3], 1)]
    assert progress == expected
    # stdout: the two "running" lines, then what comparing the finished runs prints.
    running, compared = out.splitlines()[:2], out.splitlines()[2:]
    assert [line.split(":")[0] for line in running] == ["running a", "running b"]
    assert compared == run(work / "a", work / "b", "--tolerance", 0).stdout.splitlines()
