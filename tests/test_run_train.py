"""run_train.sh before torchrun, in one process: paths typed beside it read from the directory it was started in
(torchrun itself is stubbed: the multi-process tests launch it)."""

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
