"""run_train.sh before torchrun, in one process: the interpreter it picks, and paths typed beside it read from the
directory it was started in (torchrun itself is stubbed: the multi-process tests launch it)."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.multiprocess.launch import ROOT, TINY

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
    assert proc.returncode == 0 and proc.stdout.strip() == "torchrun started", proc.stdout + proc.stderr
