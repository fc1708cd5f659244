"""several_runs.py with fp16's loss scale starting at 2**EXP instead of 2**16, so the first steps overflow and are
skipped, and with rank RANK's gradients made inf at step STEP: an overflow on that rank alone (under PP, in its
stage alone). Each rank writes its loss scale after every step to DUMP_FOLDER/loss_scale-RANK.json.

    fp16_overflow.py EXP RANK:STEP RUNS_JSON      (RUNS_JSON as several_runs.py reads it)
"""

import json
import os
import runpy
import sys
from pathlib import Path

from torch.distributed.tensor import DTensor

import train
from torchtitan_lite.runtime.precision import LossScaler, UpdateGuard

exp, (inf_rank, inf_step), runs = int(sys.argv[1]), map(int, sys.argv[2].split(":")), sys.argv[3]
rank = int(os.environ["RANK"])
LossScaler.init_scale = 2.0**exp
run, unscale_, vote = train.run, UpdateGuard.unscale_, UpdateGuard.vote
scales = {}  # the current run's loss scale after each step


class TrainState(train.TrainState):
    """train.py's, remembered: the step being taken is its step + 1, in a resumed run too."""
    current = None

    def __init__(self):
        super().__init__()
        TrainState.current = self


def poisoning_unscale_(self, optimizer):
    if rank == inf_rank and TrainState.current.step + 1 == inf_step:
        grad = next(p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
        (grad.to_local() if isinstance(grad, DTensor) else grad).fill_(float("inf"))
    unscale_(self, optimizer)


def recording_vote(self, grad_norm, n):
    skip = vote(self, grad_norm, n)
    scales[n] = self.metrics()["loss_scale"]  # updated by the vote
    return skip


def recording_run(argv):
    scales.clear()
    code = run(argv)
    folder = Path(argv[argv.index("--job.dump_folder") + 1])
    (folder / f"loss_scale-{rank}.json").write_text(json.dumps(scales))
    return code


train.TrainState, UpdateGuard.unscale_, UpdateGuard.vote, train.run = (TrainState, poisoning_unscale_, recording_vote,
                                                                       recording_run)
sys.argv = [sys.argv[0], runs]
runpy.run_path(str(Path(__file__).with_name("several_runs.py")), run_name="__main__")
