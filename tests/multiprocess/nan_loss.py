"""several_runs.py with one rank's loss turned NaN at the given steps of each run, as a corrupted batch or a
divergence would make it.

    nan_loss.py RANK STEPS RUNS_JSON      (STEPS comma-separated, counted in each run; RUNS_JSON as several_runs.py
                                           reads it)
"""

import os
import runpy
import sys
from pathlib import Path

import torch

import train

rank, steps, runs = int(sys.argv[1]), {int(s) for s in sys.argv[2].split(",")}, sys.argv[3]
step = 0
next_batch, cross_entropy, run = train.DataLoader.next_batch, torch.nn.functional.cross_entropy, train.run


def counting_next_batch(self):
    global step
    step += 1
    return next_batch(self)


def poisoned_cross_entropy(*args, **kwargs):
    loss = cross_entropy(*args, **kwargs)
    return loss * float("nan") if step in steps and int(os.environ["RANK"]) == rank else loss


def counting_run(argv: list[str]) -> int:
    global step
    step = 0
    return run(argv)


train.DataLoader.next_batch, train.run = counting_next_batch, counting_run
torch.nn.functional.cross_entropy = poisoned_cross_entropy
sys.argv = [sys.argv[0], runs]
runpy.run_path(str(Path(__file__).with_name("several_runs.py")), run_name="__main__")
