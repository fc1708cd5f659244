"""The README's quick tour, run as written and in order (its bash block under "## Quick tour"), then the five-minute
tour's first run and a later resume, in a folder that holds the repository's code as a fresh clone does: each command
must work on the default config, so the README cannot drift from what the tools accept, and the runs that share the
clone's outputs/ keep their histories apart."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import made_later
from launch import ROOT, command_env, read_history, read_metrics, resumes, run_job
from torchtitan_lite.checkpoint.folder import read_run_files
from torchtitan_lite.runtime.run_history import history_run

LINKED = ("train.py", "run_train.sh", "torchtitan_lite", "train_configs", "scripts")


def tour_commands(section: str = "Quick tour") -> str:
    readme = (ROOT / "README.md").read_text()
    block = re.search(rf"^## {section}\n.*?```bash\n(.*?)```", readme, re.S | re.M)
    assert block, f"README.md has no '## {section}' section with a bash block"
    return block.group(1)


def five_minute_run() -> str:
    """The five-minute tour's first command: a run of its own overrides in the quick tour's folder."""
    return next(line for line in tour_commands("A five-minute tour").splitlines() if "run_train.sh" in line)


def run_the_tours(folder: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """The quick tour's block, then the five-minute tour's first run, in `folder` as in a fresh clone."""
    for name in LINKED:  # the code, not the repository's own outputs/
        (folder / name).symlink_to(ROOT / name)
    # `python` is the interpreter running the suite, as in the README's venv.
    env = command_env(PATH=f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
                      CUDA_VISIBLE_DEVICES="", NGPU="2")
    return folder, run_job(["bash", "-e", "-x", "-c", f"{tour_commands()}\n{five_minute_run()}\n"], env,
                           check=False, cwd=folder)


made_later.register("readme_tours", run_the_tours)


@pytest.mark.reads("readme_tours")
def test_the_readme_tours_run_as_written_and_keep_every_runs_history(made):
    """The quick tour, then the five-minute tour's first run in the same clone: a fresh run beside the tour's
    checkpoints, told so, its history apart and the tour's whole. (That a later resume of the tour's checkpoint
    continues the tour's history, not the latest run's, test_run_history.py shows in one process.) On 2 processes,
    as on a machine of 2 GPUs (TP 2, no FSDP): half the CPU of the 4 a CPU machine gets, and TP 2 x FSDP 2, the
    default layout, trains in the shared runs (run_table.py)."""
    folder, proc = made("readme_tours")
    overrides, out = five_minute_run(), proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    # The five-minute tour's run, fresh beside the tour's checkpoints: told so, its history whole, the tour's apart.
    outputs = folder / "outputs"
    steps = int(re.search(r"--training\.steps[ =](\d+)", overrides).group(1))
    assert [r["step"] for r in read_metrics(outputs)] == list(range(1, steps + 1)) and resumes(outputs) == []
    apart = next(outputs.glob("metrics.*.jsonl"))
    tour = history_run(apart)
    assert f"{outputs / 'checkpoint'} holds step-5, step-10 and step-15 of run {tour}: checkpoint.enable is off, " \
           "so this run starts afresh" in out, out[-4000:]
    # The tour's run and its extension: every step once, the extension resumed from the tour's own checkpoint.
    assert history_run(outputs) != tour and [r["step"] for r in read_metrics(apart)] == list(range(1, 16))
    assert [(r["step"], r["run"]) for r in read_history(apart)[1]] == [(10, tour)]
    assert "training continues after step 10" in out, out[-4000:]
    # Each checkpoint holds the config that wrote it.
    for step in (5, 10, 15):
        saved_by, config = read_run_files(str(outputs / "checkpoint" / f"step-{step}"))
        assert saved_by == tour and tomllib.loads(config)["training"]["steps"] == (10 if step <= 10 else 15), step
    # generate.py prints the prompt and its continuation; the export and the plot are files.
    assert re.search(r"^def main\(.+", proc.stdout, re.M), proc.stdout[-2000:]
    assert (folder / "hf" / "config.json").is_file() and (folder / "hf" / "model.safetensors").is_file()
    assert (folder / "curves.png").stat().st_size > 0
