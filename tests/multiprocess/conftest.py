"""The suite's shared runs: each launched once per session, on first use, and read by every test that needs it.

A torchrun job costs seconds before its first step (the launcher, every rank importing torch, the mesh), and on a
2-core machine 4 ranks' collectives cost ~6 ms each, so the suite's time is its number of launches and steps. The
runs below use one config, so the same run answers the layout parity tests, the resume and resharding tests, and
the validation test. Tests read these folders and never write into them: a test that resumes a run copies the
checkpoint it needs into a folder of its own.
"""

import sys
from pathlib import Path

import pytest

# The tests here import the shared launcher as a plain module.
sys.path.insert(0, str(Path(__file__).parent))

from launch import CHECKPOINTED, COMMON, HSDP, STEPS, TP2_FSDP2, stopped_after, train_job  # noqa: E402

SHORT = ("--training.steps", "6")  # after STEPS on the command line, so it wins
# name -> (processes, overrides), all with global batch 8. One process and DDP accumulate; the 4-process layouts take
# one micro-batch per rank, since under TP each costs ~8 collectives per block (test_checkpoint.py accumulates on
# TP 2 x FSDP 2 too).
SHARED_RUNS = {
    "single": (1, ()),  # 4 micro-batches of 2
    "fsdp4": (4, CHECKPOINTED),  # 1 of 2 per rank
    # 1 of 4 per rank, each block recomputed in backward: AC leaves the numerics alone (the TP 2 x FSDP 2 reshard leg
    # of test_checkpoint.py runs without it).
    "tp2_fsdp2": (4, TP2_FSDP2),
    # Read by the layout test alone, which compares the steps both runs have: 6 show parity as well as 8.
    "tp4": (4, ("--parallelism.tensor_parallel_degree", "4", "--training.local_batch_size", "8", *SHORT)),  # 1 of 8
    "hsdp2x2": (4, (*HSDP, *SHORT)),  # 1 of 2 per rank
    # DDP is FSDP2 on a (replicate, shard = 1) mesh; 2 replicas show it as well as 4. 2 micro-batches of 2 per rank.
    "ddp2": (2, ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                 *SHORT)),
}
# name -> (run, step it resumes after, processes, overrides): a run stopped after that step and resumed to STEPS.
RESUMED_RUNS = {
    # Validating at steps 6 and 8 and keeping only the newest 2 checkpoints: steps 7 and 8 must still equal the
    # straight run's, bitwise.
    "tp2_fsdp2_resumed": ("tp2_fsdp2", 4, 4, (*TP2_FSDP2, "--checkpoint.keep_latest_k", "2", "--validation.enable",
                                              "--validation.freq", "2", "--validation.steps", "2")),
}


class SharedRuns:
    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def __getitem__(self, name: str) -> Path:
        """The dump folder of the shared run `name` (COMMON settings, STEPS steps), launched on first use."""
        if name not in self.done:
            if name in RESUMED_RUNS:
                run, step, nproc, overrides = RESUMED_RUNS[name]
                stopped_after(self[run], step, self.root / name)
            else:
                nproc, overrides = SHARED_RUNS[name]
            train_job(nproc, self.root / name, *COMMON, "--training.steps", str(STEPS), *overrides)
            self.done[name] = self.root / name
        return self.done[name]


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> SharedRuns:
    return SharedRuns(tmp_path_factory.mktemp("shared_runs"))
