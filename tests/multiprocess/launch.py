"""The shared helper of the multi-process tests: launch real torchrun jobs of train.py on the CPU, make sure none of
their processes outlives the test, and read back what they wrote."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from torchtitan_lite.runtime.run_history import read_history, read_metrics  # noqa: F401 - read_metrics: the tests' reader

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "assets" / "tiny.toml"
TINY_VOCAB = 258  # the vocabulary of tiny.toml's tokenizer, the byte-level one
TRAIN = ROOT / "train.py"
GATE = ROOT / "tests" / "multiprocess" / "gate.py"  # the shim that holds a step or kills a rank (gate.py)
# The folder whose sitecustomize.py spares each process the suite starts its last garbage collection (its docstring
# says why); tests/conftest.py adds it to every process's PYTHONPATH, torchrun_cmd to its jobs'.
QUICK_EXIT = ROOT / "tests" / "quick_exit"
# A bound on a whole job, far above any healthy run even on a loaded machine: it detects a hang, it times nothing.
TIMEOUT_S = 600

# What the shared runs (run_table.py) and the runs that resume or compare with them have in common: global batch 8 on
# every layout, and a constant lr after warmup, so the schedule does not depend on training.steps and a 4-step run
# extended to 8 is exactly the first half of an 8-step run.
STEPS = 8
COMMON = ("--training.global_batch_size", "8", "--lr_scheduler.decay_ratio", "0")
CHECKPOINTED = ("--checkpoint.enable", "--checkpoint.interval", "2")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
PP2 = ("--parallelism.pipeline_parallel_degree", "2")
DEBUGMODEL = ("--model.flavor", "debugmodel")  # 6 blocks, for 4 pipeline stages (tiny_model says why)
HSDP = ("--parallelism.data_parallel_replicate_degree", "2")
CP2 = ("--parallelism.context_parallel_degree", "2")
# A trace of every 4th step, after one step of warmup: steps 4 and 8 of an 8-step run (the shared run "fsdp4").
PROFILED = ("--profiling.enable_profiling", "--profiling.profile_freq", "4", "--profiling.profiler_warmup", "1")
TP2_FSDP2 = (*TP2, "--training.local_batch_size", "4", "--activation_checkpoint.mode", "full",
             *CHECKPOINTED)  # the shared run "tp2_fsdp2"
MOE = ("--model.flavor", "tiny_moe")  # the tests' model with every block a mixture of 8 experts, top 2
BALANCED = ("--moe.load_balance_coeff", "1e-3")  # DeepSeek-V3's bias balancing (training/expert_load.py)
EP2, EP4 = ("--parallelism.expert_parallel_degree", "2"), ("--parallelism.expert_parallel_degree", "4")
QWEN3, QWEN3_MOE = ("--model.flavor", "debugmodel"), ("--model.flavor", "debugmodel_moe")  # with --model.name qwen3
# Document masking on short documents (tests/assets/documents.jsonl: 1 to 12 words each, several to a window).
MASKED = ("--model.attn_mask_type", "block_causal", "--training.dataset", "jsonl", "--training.dataset_path",
          str(ROOT / "tests" / "assets" / "documents.jsonl"))

# Float8 as the CPU runs it (torchao's emulated float8 matmuls: the numerics, not the speed).
FLOAT8 = ("--float8.enable_float8_linear", "--float8.emulate")


def tiny_model():
    """The ModelArgs of what tiny.toml trains: flavor "tiny", the debug model's width in 2 blocks (most of a test
    run's time goes block by block, and no test needs more blocks than pipeline stages; the layouts of 4 stages train
    "debugmodel"'s 6, as the reference curve does)."""
    from torchtitan_lite.config import load_config  # noqa: PLC0415 - torch's import, for the tests that build models
    from torchtitan_lite.models import registry  # noqa: PLC0415

    cfg = load_config(["--job.config_file", str(TINY)])
    return registry.get(cfg.model.name).run_args(cfg, TINY_VOCAB)


def descendants(pid: int) -> list[int]:
    """pid's child processes, recursively: torchrun starts each worker in a session of its own, so killing torchrun's
    process group would leave them running."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    return [p for c in children for p in (c, *descendants(c))]


def running(pid: int) -> bool:
    """Whether process `pid` is alive: any of its threads is not a zombie. A killed process's first thread can be a
    zombie while others still end, and its files (a lock among them) are closed only when the last one has."""
    alive = False
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, IndexError):
            alive |= (task / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return alive


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILLs a launcher and every process below it at once, like a node failure, and reaps the launcher."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


# Set in the thread that makes shared jobs in the background (conftest.py): the jobs it starts (start_job, run_job,
# any command given command_env) run at the lowest CPU priority, start_job's launcher in a session of its own
# (tests/quick_exit/sitecustomize.py).
_background = threading.local()
# What run_job started from that thread, which the pytest session kills at its end if it still runs (a session
# interrupted while the thread waits for it: the thread dies with the session, not the job).
STARTED_IN_BACKGROUND: list[subprocess.Popen] = []


@contextlib.contextmanager
def in_background():
    """Jobs started inside take only the cores that the other tests leave idle."""
    _background.on = True
    try:
        yield
    finally:
        _background.on = False


def torchrun_cmd(nproc: int, script: Path, *args: str,
                 launcher: tuple[str, ...] = ("--standalone",)) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a CPU torchrun job, no GPU: by default a rendezvous port of its own
    (--standalone); `launcher` replaces that with other torchrun options."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, f"--nproc_per_node={nproc}", str(script), *args]
    return cmd, command_env(PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=f"{ROOT}{os.pathsep}{QUICK_EXIT}")


def command_env(**extra: str) -> dict[str, str]:
    """The environment of a command a test starts, with `extra`: in the background thread, every Python process it
    starts takes the lowest CPU priority (tests/quick_exit/sitecustomize.py reads SUITE_BACKGROUND)."""
    env = {**os.environ, **extra}
    if getattr(_background, "on", False):
        env["SUITE_BACKGROUND"] = "1"
    return env


def run_job(cmd: list[str], env: dict[str, str], check: bool = True, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run a launcher command (or a script, a shell) to its end; raise with the output's tail if it fails and
    `check`. A job still running after TIMEOUT_S is killed, workers included, and fails."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if getattr(_background, "on", False):
        STARTED_IN_BACKGROUND.append(proc)
    return _finish(proc, check)


def _finish(proc: subprocess.Popen, check: bool, log: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Waits for a started job (its output piped, or in `log`), killing it and its workers if it hangs or the wait
    is interrupted; raises with the output's tail if it hung, or failed and `check`."""
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        hung = False
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        stdout, stderr = proc.communicate()
        hung = True
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): leave no worker behind
            kill_tree(proc)
    if log is not None:
        stdout, stderr = log.read_text(), ""
    if hung:
        raise AssertionError(f"the job hung for {TIMEOUT_S}s:\n{(stdout + stderr)[-4000:]}")
    if check and proc.returncode != 0:
        raise AssertionError(f"the job failed ({proc.returncode}):\n{(stdout + stderr)[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def train_argv(dump_folder: Path, *overrides: str, config: Path = TINY) -> tuple[str, ...]:
    """train.py's arguments: the config file, the dump folder, then the overrides."""
    return ("--job.config_file", str(config), "--job.dump_folder", str(dump_folder), *overrides)


def torchrun(nproc: int, dump_folder: Path, *overrides: str, config: Path = TINY, script: Path = TRAIN,
             script_args: tuple[str, ...] = (), check: bool = True, env: dict[str, str] | None = None,
             launcher: tuple[str, ...] = ("--standalone",)) -> subprocess.CompletedProcess:
    """Run train.py (or `script script_args...` followed by train.py's arguments) on `nproc` local gloo processes,
    as run_job does."""
    cmd, base_env = torchrun_cmd(nproc, script, *script_args, *train_argv(dump_folder, *overrides, config=config),
                                 launcher=launcher)
    return run_job(cmd, {**base_env, **(env or {})}, check)


SEVERAL_RUNS = ROOT / "tests" / "multiprocess" / "several_runs.py"


def torchrun_several(nproc: int, runs: list[tuple[Path, bool, tuple[str, ...]]], script: Path = SEVERAL_RUNS,
                     script_args: tuple[str, ...] = (), check: bool = True) -> subprocess.CompletedProcess:
    """Several runs of train.py, each (dump folder, record its gradients (grad_dump.py), overrides), one after another
    in one torchrun job (several_runs.py, or `script script_args... RUNS_JSON`, a shim that runs it), which pays the
    start-up of a job once; the first run that fails ends the job (as run_job, with `check`)."""
    return run_job(*torchrun_cmd(nproc, script, *script_args, str(_runs_json(runs))), check)


def _runs_json(runs: list[tuple[Path, bool, tuple[str, ...]]]) -> Path:
    spec = [[str(folder), record, list(train_argv(folder, *overrides))] for folder, record, overrides in runs]
    path = Path(runs[0][0]).with_suffix(".runs.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    return path


def start_several(nproc: int, runs: list[tuple[Path, bool, tuple[str, ...]]], log: Path,
                  probes_spec: Optional[Path] = None) -> subprocess.Popen:
    """torchrun_several's job, started and left running, its output going to `log`: end it with finish_job. With
    `probes_spec`, probes.py's parts run after the runs, in the same job."""
    spec = () if probes_spec is None else (str(probes_spec),)
    return start_job(*torchrun_cmd(nproc, SEVERAL_RUNS, str(_runs_json(runs)), *spec), log)


def start_job(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A launcher command, started and left running, its output going to `log`: end it with finish_job."""
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session="SUITE_BACKGROUND" in env)


def finish_job(proc: subprocess.Popen, log: Path) -> None:
    """Waits for a job start_several began; raises with its log's tail if it fails or hangs (then killed)."""
    _finish(proc, True, log)


# Recovery bounds of the multi-agent jobs (README, "Running on a cluster"): a round closes 1 s after its minimum of
# nodes is there, and a node silent for 10 heartbeats of 1 s (one is sent every second) is dropped from the next one.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=10"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(nnodes: str, port: int, run_id: str, script: Path, *args: str) -> subprocess.Popen:
    """One node's torchrun, as on a machine of its own: 2 processes, a c10d rendezvous on 127.0.0.1:port, restarts
    allowed; its output (stderr included) in stdout. The caller kills it (kill_tree) if it outlives the test."""
    cmd, env = torchrun_cmd(2, script, *args, launcher=(
        "--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        "--rdzv-conf", RDZV_CONF, "--max-restarts", "3"))
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as run_train.sh and multinode_trainer.slurm set it
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_until(condition, what: str, *procs: subprocess.Popen) -> None:
    """Polls `condition` while every one of `procs` runs; fails if one ends first, or after TIMEOUT_S (a hang
    detector, not a timing)."""
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        for p in procs:
            assert p.poll() is None, f"a job ended before {what}:\n{(p.communicate()[0] or '')[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {TIMEOUT_S}s"
        time.sleep(0.05)


def logged(dump_folder: Path) -> int:
    """How many steps the job's metrics.jsonl holds so far (0 before it exists)."""
    return len(read_metrics(dump_folder)) if (Path(dump_folder) / "metrics.jsonl").exists() else 0


def train_in_process(dump_folder: Path, *overrides: str, config: Path = TINY,
                     check: bool = True) -> subprocess.CompletedProcess:
    """train.py's run() in this process: one process, without torchrun's seconds of start-up, where the test is not
    about the launcher. Answers like torchrun(): the log in stdout, what went to stderr (an error line) in stderr."""
    import train  # noqa: PLC0415 - the trainer's imports are only needed by the tests that run it here

    argv = list(train_argv(dump_folder, *overrides, config=config))
    log, err = io.StringIO(), io.StringIO()
    handler, logger = logging.StreamHandler(log), logging.getLogger("torchtitan_lite")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stderr(err):
            code = train.run(argv)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    if check and code != 0:
        raise AssertionError(f"train.run failed ({code}):\n{(log.getvalue() + err.getvalue())[-4000:]}")
    return subprocess.CompletedProcess(argv, code, log.getvalue(), err.getvalue())


def train_job(nproc: int, dump_folder: Path, *overrides: str, **kw) -> subprocess.CompletedProcess:
    """A training run on `nproc` processes: a torchrun job, or with one process train_in_process, since a test
    whose subject is not the launcher need not pay its seconds of start-up."""
    if nproc == 1:
        return train_in_process(dump_folder, *overrides, **kw)
    return torchrun(nproc, dump_folder, *overrides, **kw)


def error_lines(proc: subprocess.CompletedProcess, expected: str) -> list[str]:
    """The `error: ...` lines of a job's output that mention `expected`."""
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "error: " in line and expected in line]


def assert_one_error_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    """The job failed and said why exactly once."""
    assert proc.returncode != 0
    assert len(error_lines(proc, expected)) == 1, (proc.stdout + proc.stderr)[-3000:]


def ckpt(folder: Path, step: int) -> Path:
    return Path(folder) / "checkpoint" / f"step-{step}"


def stopped_after(run: Path, step: int, folder: Path) -> Path:
    """`folder` as if `run` (saving every 2 steps) had stopped after `step`: its checkpoints and metrics up to there."""
    for s in range(2, step + 1, 2):
        shutil.copytree(ckpt(run, s), ckpt(folder, s))
    with open(run / "metrics.jsonl") as src, open(folder / "metrics.jsonl", "w") as dst:
        dst.writelines(line for line in src if json.loads(line)["step"] <= step)
    return folder


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under folder with its content hash and mtime: equal snapshots mean nothing was touched."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return out


def resumes(dump_folder: Path) -> list[dict]:
    """The resume records of the job's metrics.jsonl: each step a run resumed from, in order."""
    return read_history(dump_folder)[1]


def metric(dump_folder: Path, key: str) -> dict[int, float]:
    """step -> the logged `key`; a resumed run's later line for a step wins."""
    return {m["step"]: m[key] for m in read_metrics(dump_folder) if key in m}


def losses(dump_folder: Path) -> dict[int, float]:
    return metric(dump_folder, "loss")


def curve(dump_folder: Path) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad norm), for bitwise comparisons: see assert_same_curve."""
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in read_metrics(dump_folder) if "loss" in m}


def assert_same_curve(got: Path, ref: Path, tolerance: float, steps=None) -> dict[str, float]:
    """`got`'s loss at each of `steps` (default: every step it logged) is `ref`'s within `tolerance`, and its
    gradient norm within `tolerance` relative. The norm too, since AdamW cancels a constant gradient scale: every
    gradient x4 (a missing 1/dp) moves an 8-step loss curve by ~5e-7 and the norm x4. Returns the worst of each."""
    worst = {}
    for key, relative in (("loss", False), ("grad_norm", True)):
        a, b = metric(got, key), metric(ref, key)
        at = sorted(a) if steps is None else list(steps)
        assert at and set(at) <= a.keys() & b.keys(), f"{key}: steps {sorted(a)} vs {sorted(b)}"
        worst[key] = max(abs(a[s] - b[s]) / (abs(b[s]) if relative else 1) for s in at)
        assert worst[key] <= tolerance, f"{key} differs by {worst[key]:.2e} (tolerance {tolerance:g}{' relative' * relative})"
    print(f"max |loss diff| {worst['loss']:.2e}, grad norm relative diff {worst['grad_norm']:.2e}")
    return worst
