"""What a shared run is (run_table.py holds them by name): `Run`, `Resumed`, and the kinds a run's config makes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pairs
from torchtitan_lite.config import JobConfig
from torchtitan_lite.parallel.dims import ParallelDims


@dataclass(frozen=True)
class Run:
    """A shared run: made once per session, in the job of every shared run of its processes (conftest.py)."""
    nproc: int
    overrides: tuple[str, ...] = ()  # train.py's, after launch.COMMON and --training.steps STEPS, so they win
    # The single-process run it is compared with: most train the tests' model in fp32 as "single" does. None: it is
    # one itself.
    reference: Optional[str] = "single"
    model: str = "llama3"  # model.name: the architecture it trains
    record: bool = True  # every parameter's gradient at step 1 (grad_dump.py), which the parity tests compare

    @property
    def argv(self) -> tuple[str, ...]:
        """Its train.py overrides, the model first: a run always says which architecture it trains."""
        return ("--model.name", self.model, *self.overrides)

    @property
    def config(self) -> JobConfig:
        """Its JobConfig, as train.py loads it (pairs.parsed: cached, so shared; never changed)."""
        return pairs.parsed(self.nproc, self.argv)[0]

    @property
    def dims(self) -> ParallelDims:
        """Its mesh degrees (pp, cp, tp, dp_replicate, dp_shard), as the trainer derives them from its config."""
        return pairs.parsed(self.nproc, self.argv)[1]


@dataclass(frozen=True)
class Resumed:
    """The shared run `run` stopped after `after_step` and resumed in a new job, on `nproc` processes and the
    overrides here (the run's layout or another). The resumed runs of one size are made in one job of their own,
    after the shared runs', so none shares a process with the run it resumes."""
    run: str
    after_step: int
    nproc: int
    overrides: tuple[str, ...]
    model: str = "llama3"  # the run's: a checkpoint loads into the architecture that saved it (test_run_table.py)
    record: bool = False  # as Run's, with graphs.json (grad_dump.py); most resumes are checked by their curve
    # A resharding leg that reads the run's checkpoint where it lies (checkpoint.initial_load_path), which must stay
    # as it was, rather than a copy in its own folder.
    initial_load: bool = False

    argv = Run.argv


# A run's kinds, from what the trainer parses: the tests of each kind parametrize over its runs.
KINDS = {
    "pipelined": lambda run: run.dims.pp > 1,
    "context_parallel": lambda run: run.dims.cp > 1,
    "compiled": lambda run: run.config.compile.enable,
}


def of_kind(runs: dict[str, Run], kind: str) -> list[str]:
    """The names of `runs` of `kind` (KINDS), in the table's order."""
    return [name for name, run in runs.items() if KINDS[kind](run)]


SHORT = ("--training.steps", "4")  # after STEPS on the command line, so it wins
