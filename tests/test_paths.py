"""Paths typed on the command line are the caller's files, those of a TOML file the working directory's, and a missing
file is named by the absolute path that was tried (torchtitan_lite/config/paths.py; run_train.sh's side: test_run_train.py)."""

import os
import re

import pytest

from torchtitan_lite.config import ConfigError, load_config, to_toml
from torchtitan_lite.config.paths import CALLER_DIR
from torchtitan_lite.data.loader import build_source
from torchtitan_lite.data.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture
def caller(tmp_path, monkeypatch):
    """A caller's directory, and the working directory elsewhere (the repository, where run_train.sh moves)."""
    (tmp_path / "caller" / "cfg").mkdir(parents=True)
    (tmp_path / "repo").mkdir()
    monkeypatch.setenv(CALLER_DIR, str(tmp_path / "caller"))
    monkeypatch.chdir(tmp_path / "repo")
    return tmp_path / "caller"


def test_paths_on_the_command_line_are_the_callers_and_the_tomls_stay_as_written(caller):
    (caller / "cfg" / "c.toml").write_text('[model]\ntokenizer_path = "assets/bpe.tiktoken"\n'
                                           '[validation]\ndataset_path = "held/out.jsonl"\n')
    cfg = load_config(["--job.config_file", "cfg/c.toml", "--job.dump_folder", "out", "--training.dataset_path",
                       "a.jsonl, docs/*.jsonl", "--checkpoint.initial_load_path", "~/ckpt/step-5"])
    assert cfg.job.config_file == str(caller / "cfg" / "c.toml")  # read from there: the TOML values below are its
    assert cfg.job.dump_folder == str(caller / "out")
    assert cfg.training.dataset_path == f"{caller}/a.jsonl,{caller}/docs/*.jsonl"  # each of a comma-separated list
    assert cfg.checkpoint.initial_load_path == os.path.expanduser("~/ckpt/step-5")
    assert cfg.model.tokenizer_path == "assets/bpe.tiktoken" and cfg.validation.dataset_path == "held/out.jsonl"
    # config.toml names the caller's files absolutely: a rerun from any directory finds them.
    assert f'dump_folder = "{caller / "out"}"' in to_toml(cfg)


def test_values_that_name_no_relative_file_are_kept(caller):
    cfg = load_config(["--model.tokenizer_path", "", "--job.dump_folder", "/abs/out", "--training.dataset", "hf",
                       "--training.dataset_path", "allenai/c4:en"])  # "": no file; hf: a name on the Hub
    assert (cfg.model.tokenizer_path, cfg.job.dump_folder, cfg.training.dataset_path) == ("", "/abs/out",
                                                                                         "allenai/c4:en")


def test_without_run_train_sh_the_caller_is_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(CALLER_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    assert load_config(["--job.dump_folder", "out"]).job.dump_folder == str(tmp_path / "out")


def test_a_missing_file_is_named_by_the_absolute_path_tried(caller):
    def names(text: str):
        return pytest.raises(ConfigError, match=re.escape(text))

    with names(f"config file not found: {caller}/cfg/nope.toml "):
        load_config(["--job.config_file", "cfg/nope.toml"])
    # The TOML's relative paths are tried in the working directory, and named from there.
    repo = os.getcwd()
    with names(f"training.dataset_path: {repo}/nope.jsonl does not exist"):
        build_source("jsonl", "nope.jsonl", 8, Tokenizer.byte_level(), 0)
    with names(f"training.dataset_path: '{repo}/nope/*.jsonl' matches no file"):
        build_source("jsonl", "nope/*.jsonl", 8, Tokenizer.byte_level(), 0)
    with names(f"model.tokenizer_path: tokenizer file {repo}/bpe.tiktoken not found"):
        load_tokenizer("bpe.tiktoken")
