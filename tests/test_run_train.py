"""run_train.sh before torchrun, in one process: the interpreter it picks, and paths typed beside it read from the
directory it was started in (torchrun itself is stubbed: the multi-process tests launch it)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.multiprocess.launch import ROOT, TINY, kill_tree, train_in_process
from tests.test_train import n_params
from torchtitan_lite.runtime import run_lock
from torchtitan_lite.runtime.run_history import history_run

SCRIPT = str(ROOT / "run_train.sh")
BASH = shutil.which("bash")


def stub(path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.mark.parametrize("on_path, python_env, picked", [
    (("python", "python3"), None, "python"),
    (("python3",), None, "python3"),  # outside a virtual environment many systems only have python3
    (("python", "python3"), "custom", "custom"),
])
def test_the_interpreter_is_PYTHON_else_python_else_python3(tmp_path, on_path, python_env, picked):
    # PATH holds only the stubs and what the script runs before its interpreter (dirname), so the machine's own
    # pythons play no part. Each stub says who it is instead of checking the config.
    for name in (*on_path, "custom"):
        stub(tmp_path / name, f'echo "{name} $*"; exit 3')
    os.symlink(shutil.which("dirname"), tmp_path / "dirname")
    env = {"PATH": str(tmp_path), "NGPU": "1", **({"PYTHON": str(tmp_path / python_env)} if python_env else {})}
    proc = subprocess.run([BASH, SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and proc.stdout.startswith(f"{picked} train.py --check "), proc.stdout + proc.stderr


def test_without_any_python_one_line_says_to_set_PYTHON(tmp_path):
    os.symlink(shutil.which("dirname"), tmp_path / "dirname")
    proc = subprocess.run([BASH, SCRIPT], env={"PATH": str(tmp_path), "NGPU": "1"}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 127 and proc.stdout == "", proc.stdout
    assert proc.stderr.splitlines() == [
        "error: neither python nor python3 is on PATH: set PYTHON to the interpreter that has torch"]


def test_paths_typed_beside_it_are_the_callers_files(tmp_path):
    """Started from another directory: CONFIG_FILE, the dataset and the dump folder given relative are the caller's,
    and the config's own tokenizer path stays the repository's. The real `train.py --check` accepts them."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.toml").write_text(TINY.read_text().replace(
        "[model]\n", '[model]\ntokenizer_path = "torchtitan_lite/assets/stdlib_bpe_2k.tiktoken"\n'))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.jsonl").write_text('{"text": "%s"}\n' % ("the caller's own words " * 40))
    python = tmp_path / "python"
    stub(python, f'[ "$1" = -m ] && {{ echo "torchrun started"; exit 0; }}\nexec "{sys.executable}" "$@"')
    env = {**os.environ, "PYTHON": str(python), "NGPU": "1", "CONFIG_FILE": "configs/tiny.toml",
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([SCRIPT, "--training.dataset", "jsonl", "--training.dataset_path", "data/corpus.jsonl",
                           "--job.dump_folder", "out"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "torchrun started", proc.stdout + proc.stderr


def launcher_stub(tmp_path, torchrun: str = 'echo "torchrun started"', plan: str = "") -> dict:
    """run_train.sh's environment with `python -m torch.distributed.run` replaced by `torchrun` (a shell body) and
    the real interpreter for everything else (train.py --check, --help); with `plan`, the check too is replaced by one
    that writes that plan file (tests of the script's own logic, spared the check's seconds of importing torch)."""
    python = tmp_path / "python"
    check = f'if [ "$2" = --check ]; then printf "{plan}" > "$TORCHTITAN_LITE_PLAN_FILE"; exit 0; fi\n' if plan else ""
    torchrun = f'if [ "$2" = torch.distributed.run ]; then {torchrun}; exit 0; fi\n'
    stub(python, f'{torchrun}{check}exec "{sys.executable}" "$@"')
    # TMPDIR: the script's plan and error files, which a test that kills it with SIGKILL leaves behind, stay here.
    return {**os.environ, "PYTHON": str(python), "NGPU": "2", "CONFIG_FILE": str(TINY), "CUDA_VISIBLE_DEVICES": "",
            "TMPDIR": str(tmp_path)}


def wait_for_torchrun(proc: subprocess.Popen) -> None:
    """Reads the script's output up to the stub torchrun's first line; fails if the script ends before it."""
    for line in proc.stdout:
        if "torchrun started" in line:
            return
    raise AssertionError(f"run_train.sh ended before torchrun, exit {proc.wait()}")


def starts(dump_folder) -> str:
    """A stubbed check's plan for a run into `dump_folder` that has work to do."""
    return f"dump_folder={dump_folder}\\ncheckpoint_folder=\\nnothing_to_do=0\\n"


def test_check_anywhere_only_checks_from_the_script_and_from_train_py(tmp_path):
    """`--check` after the overrides, as a user appends it to a command that trains: the real check's plan, exit 0,
    no torchrun; and train.py takes it anywhere too (before, only as its first argument: the rest trained)."""
    overrides = ["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path / "out"), "--training.steps", "2"]
    proc = subprocess.run([SCRIPT, *overrides, "--check"], env={**launcher_stub(tmp_path), "NGPU": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "torchrun started" not in proc.stdout, proc.stdout + proc.stderr
    assert "data synthetic: 2 steps" in proc.stdout, proc.stdout
    proc = subprocess.run([sys.executable, "train.py", *overrides, "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "WORLD_SIZE": "1"})
    assert proc.returncode == 0 and "data synthetic: 2 steps" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_help_is_printed_once_and_starts_nothing(tmp_path):
    proc = subprocess.run([SCRIPT, "--training.steps", "3", "--help"], env=launcher_stub(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("usage: train.py") == 1, proc.stdout + proc.stderr
    assert "torchrun started" not in proc.stdout and "[training]" in proc.stdout


def test_a_missing_config_file_is_named_as_CONFIG_FILE(tmp_path):
    env = {**launcher_stub(tmp_path), "CONFIG_FILE": "nope.toml"}
    proc = subprocess.run([SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.splitlines() == [
        f"error: CONFIG_FILE=nope.toml: no such file (relative to {tmp_path}): set CONFIG_FILE to a TOML config, e.g. "
        "train_configs/debug_model.toml"]


@pytest.mark.parametrize("groups", ["two", "0"])
def test_a_bad_number_of_replica_groups_is_named_as_REPLICA_GROUPS(tmp_path, groups):
    env = {**launcher_stub(tmp_path), "REPLICA_GROUPS": groups}
    proc = subprocess.run([SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.splitlines() == [f"error: REPLICA_GROUPS={groups}: set it to the number of replica groups (1 or "
                                        "more), or unset it"]


def test_the_check_prints_the_plan_and_a_finished_run_starts_no_worker(tmp_path):
    train_in_process(tmp_path / "out", "--training.steps", "2", "--checkpoint.enable")
    env = launcher_stub(tmp_path)
    more = subprocess.run([SCRIPT, "--job.dump_folder", str(tmp_path / "out"), "--training.steps", "4",
                           "--checkpoint.enable"], env=env, capture_output=True, text=True, timeout=120)
    assert more.returncode == 0, more.stdout + more.stderr
    run = history_run(tmp_path / "out")
    assert more.stdout.splitlines() == [
        f"llama3 tiny: {n_params(TINY) / 1e6:.2f}M parameters, mesh dp_shard 2 on 2 processes, causal attention, "
        "float32",
        "data synthetic: 4 steps of 4 x 64 = 256 tokens (2 sequences a rank per micro-batch, 1 micro-batch)",
        f"outputs in {tmp_path / 'out'}: metrics.jsonl, config.toml; checkpoints every 500 steps in "
        f"{tmp_path / 'out' / 'checkpoint'}, resuming step-2 of run {run}",
        "starting 2 processes (torchrun)", "torchrun started"]
    done = subprocess.run([SCRIPT, "--job.dump_folder", str(tmp_path / "out"), "--training.steps", "2",
                           "--checkpoint.enable"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "torchrun started" not in done.stdout, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == (
        f"the checkpoint {tmp_path / 'out' / 'checkpoint' / 'step-2'} is at step 2 and training.steps is 2: nothing "
        "to do (raise training.steps to extend the run)")


def test_the_workers_keep_torchruns_shared_store(tmp_path):
    """Unshared (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), rank 0 would serve a store on the port torchrun's agent found
    free seconds before, which another job on the machine can take meanwhile: the suite's quick tour once failed so
    (EADDRINUSE). A value the caller sets still reaches torchrun."""
    torchrun = 'echo "torchrun started, store unshared: ${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-no}"'
    env = launcher_stub(tmp_path, torchrun, plan=starts(tmp_path / "out"))
    for given, said in ((None, "no"), ("1", "1")):
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        proc = subprocess.run([SCRIPT, "--job.dump_folder", str(tmp_path / "out")], capture_output=True, text=True,
                              env={**env, **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": given} if given else {})},
                              timeout=120)
        assert f"torchrun started, store unshared: {said}" in proc.stdout, proc.stdout + proc.stderr


def test_the_jobs_error_line_comes_last_after_torchruns_summary(tmp_path):
    """torchrun's summary names the first rank to exit ("Root Cause ... rank 1"), which may not be the one whose line
    explains the failure: the line a rank said (errors.py writes it to TORCHTITAN_LITE_ERROR_LOG too) comes last."""
    said = "error: a collective waited longer than ...; rank 2 did not join all_gather #7"
    torchrun = (f'echo "{said}" >&2; echo "{said}" >> "$TORCHTITAN_LITE_ERROR_LOG"; '
                'printf "Root Cause (first observed failure):\\n  rank : 1\\n====\\n" >&2; exit 1')
    env = launcher_stub(tmp_path, torchrun, plan=starts(tmp_path / 'out'))
    proc = subprocess.run([SCRIPT, "--job.dump_folder", str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.splitlines()[-1] == said, proc.stderr
    assert proc.stderr.count(said) == 2


def test_a_second_ctrl_c_says_what_was_kept(tmp_path):
    """With checkpointing off, the job killed at once saved nothing, and says so (it used to say the newest
    checkpoint was kept)."""
    env = launcher_stub(tmp_path, 'echo "torchrun started"; sleep 60', plan=starts(tmp_path / 'out'))
    proc = subprocess.Popen([SCRIPT, "--job.dump_folder", str(tmp_path / "out")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for_torchrun(proc)  # the check is done, torchrun (the stub) runs
        for _ in range(2):
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.2)  # two presses, not one: bash runs a trap once per signal it sees
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 130 and err.splitlines()[-1] == (
        "second Ctrl-C: stopped at once; checkpoint.enable is off: nothing was saved"), err


def test_of_two_scripts_started_at_once_into_one_folder_the_second_starts_nothing(tmp_path):
    """Both pass their checks before either job has a rank 0 to hold the folder (the checks are stubbed here, as if
    both ran at the same moment): the first script holds the lock for its job, and the second is refused in one
    line with exit 2 before it starts torchrun."""
    folder = tmp_path / "out"
    env = launcher_stub(tmp_path, 'echo "torchrun started"; sleep 600', plan=starts(folder))
    first = subprocess.Popen([SCRIPT, "--job.dump_folder", str(folder)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        wait_for_torchrun(first)
        second = subprocess.run([SCRIPT, "--job.dump_folder", str(folder)], env=env, capture_output=True, text=True,
                                timeout=120)
    finally:
        kill_tree(first)
    assert second.returncode == 2 and "torchrun started" not in second.stdout, second.stdout + second.stderr
    assert second.stderr.splitlines() == [
        f"error: job.dump_folder {folder} is in use by a live run (pid {first.pid} on {socket.gethostname()}, since "
        f"{json.loads((folder / 'run.lock').read_text())['since']}): wait for it to end, or give this run a folder of "
        "its own (--job.dump_folder)"]


def test_a_folder_a_live_run_holds_is_refused_and_a_killed_one_is_not(tmp_path):
    """A live run's rank 0 holds the folder's lock: a second run into it is refused in one line before any worker
    starts. SIGKILLed, it leaves no lock behind: the kernel drops a dead process's lock."""
    folder = tmp_path / "out"
    code = f"from torchtitan_lite.runtime import run_lock\nwith run_lock.hold({str(folder)!r}):\n print('held', " \
           "flush=True)\n import time; time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        refused = subprocess.run([SCRIPT, "--job.dump_folder", str(folder)], env=launcher_stub(tmp_path),
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "torchrun started" not in refused.stdout, refused.stdout + refused.stderr
        assert refused.stderr.splitlines() == [
            f"error: job.dump_folder {folder} is in use by a live run (pid {holder.pid} on {socket.gethostname()}, "
            f"since {json.loads((folder / 'run.lock').read_text())['since']}): wait for it to end, or give this run "
            "a folder of its own (--job.dump_folder)"]
    finally:
        holder.kill()
        holder.wait()
    run_lock.check_free(str(folder))  # what the check asks: the lock is free again (it raises otherwise)
    with run_lock.hold(str(folder)):  # and a run may take it
        pass
