"""Fixtures of the unit tests (tests/multiprocess/conftest.py has the multi-process ones)."""

import os
from pathlib import Path

import pytest

import train
from tests.multiprocess.launch import QUICK_EXIT

TINY = Path(__file__).parent / "assets" / "tiny.toml"
# Every Python process a test starts, whichever way, finds tests/quick_exit/sitecustomize.py.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(QUICK_EXIT)]))


@pytest.fixture
def error_line(tmp_path, monkeypatch, capsys):
    """`train.py --check` of the tests' config with `overrides` for `world` processes, which must refuse it: its one
    error line (what run_train.sh shows before starting torchrun)."""
    def check(world: int, overrides: list[str]) -> str:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        code = train.run(["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path), *overrides], check=True)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
        return err[0]
    return check
