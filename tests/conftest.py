"""Fixtures of the unit tests (tests/multiprocess/conftest.py has the multi-process ones)."""

import gc
import os

# OpenMP threads that wait at the end of a parallel region sleep instead of spinning (set before torch loads its
# OpenMP runtime, for this process and every one it starts). libgomp's default spins ~300,000 times first: while
# anything else runs on the suite's 2 cores (a job's launcher, an async save's thread, another process), the waiting
# thread burns the core its partner needs, and a 4-step in-process run took 150-250 s instead of 5-7 s at load 8.
# torchrun's workers run one thread each (OMP_NUM_THREADS=1) and are unaffected; no number depends on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# This process holds torch, transformers and the tests' modules, millions of objects that a full collection walks
# (0.3 s each): collecting the youngest generation every 10,000 allocations rather than 700 makes 4 full collections
# of the unit tests instead of 24 (5 CPU s less), and a cycle lives a few thousand allocations longer.
gc.set_threshold(10_000, 10, 10)

from pathlib import Path  # noqa: E402 - after the environment above

import pytest  # noqa: E402

import train  # noqa: E402
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
