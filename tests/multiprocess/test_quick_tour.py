"""The README's quick tour, run as written and in order (its bash block under "## Quick tour"), in a folder that
holds the repository's code as a fresh clone does: each command must work on the default config, so the README
cannot drift from what the tools accept."""

import json
import os
import re
import subprocess
import sys

from launch import ROOT, TIMEOUT_S, resumes

LINKED = ("train.py", "run_train.sh", "torchtitan_lite", "train_configs", "scripts")


def tour_commands() -> str:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## Quick tour\n.*?```bash\n(.*?)```", readme, re.S | re.M)
    assert block, "README.md has no '## Quick tour' section with a bash block"
    return block.group(1)


def test_the_readme_quick_tour_runs_as_written(tmp_path):
    for name in LINKED:  # the code, not the repository's own outputs/
        (tmp_path / name).symlink_to(ROOT / name)
    commands = tour_commands()
    # `python` is the interpreter running the suite, as in the README's venv.
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
           "CUDA_VISIBLE_DEVICES": ""}
    env.pop("NGPU", None)
    proc = subprocess.run(["bash", "-e", "-x", "-c", commands], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    # The run and its extension: every step once, the extension resumed from the first run's last checkpoint.
    outputs = tmp_path / "outputs"
    steps = [r["step"] for r in map(json.loads, (outputs / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == list(range(1, 16)), steps
    assert {"step-10", "step-15"} <= {p.name for p in (outputs / "checkpoint").iterdir()}
    assert "training continues after step 10" in out, out[-4000:]
    assert [r["step"] for r in resumes(outputs)] == [10] and (outputs / "config.step-10.toml").is_file()
    # generate.py prints the prompt and its continuation; the export and the plot are files.
    assert re.search(r"^def main\(.+", proc.stdout, re.M), proc.stdout[-2000:]
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()
    assert (tmp_path / "curves.png").stat().st_size > 0
