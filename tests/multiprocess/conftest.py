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

from launch import CHECKPOINTED, COMMON, HSDP, STEPS, TP2, TP2_FSDP2, torchrun  # noqa: E402

# name -> (processes, overrides), all with global batch 8. Accumulation is exercised where it matters (1 process,
# TP x FSDP); elsewhere one micro-batch per rank, since under TP every micro-batch costs ~8 collectives per block.
SHARED_RUNS = {
    "single": (1, ()),  # 4 micro-batches of 2
    "fsdp4": (4, CHECKPOINTED),  # 1 of 2 per rank
    "tp2_fsdp2": (4, TP2_FSDP2),  # 1 of 4 per rank
    "tp4": (4, ("--parallelism.tensor_parallel_degree", "4", "--training.local_batch_size", "8")),  # 1 of 8
    "hsdp2x2": (4, HSDP),  # 1 of 2 per rank
    "ddp4": (4, ("--parallelism.data_parallel_replicate_degree", "4", "--parallelism.data_parallel_shard_degree", "1")),
    # 2 micro-batches of 2 per rank, each block recomputed in backward: accumulation and AC leave the numerics alone.
    "tp2_fsdp2_full_ac": (4, (*TP2, "--activation_checkpoint.mode", "full")),
}


class SharedRuns:
    def __init__(self, root: Path):
        self.root, self.done = root, {}

    def __getitem__(self, name: str) -> Path:
        """The dump folder of the shared run `name` (COMMON settings, STEPS steps), launched on first use."""
        if name not in self.done:
            nproc, overrides = SHARED_RUNS[name]
            torchrun(nproc, self.root / name, *COMMON, "--training.steps", str(STEPS), *overrides)
            self.done[name] = self.root / name
        return self.done[name]


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> SharedRuns:
    return SharedRuns(tmp_path_factory.mktemp("shared_runs"))
