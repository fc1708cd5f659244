"""train.py with one rank's loss turned NaN at the given steps, as a corrupted batch or a divergence would make it.

    nan_loss.py RANK STEPS TRAIN_ARGS...      (STEPS comma-separated; counts the training steps of this launch)
"""

import os
import sys

import torch

import train

rank, steps, argv = int(sys.argv[1]), {int(s) for s in sys.argv[2].split(",")}, sys.argv[3:]
step = 0
next_batch, cross_entropy = train.DataLoader.next_batch, torch.nn.functional.cross_entropy


def counting_next_batch(self):
    global step
    step += 1
    return next_batch(self)


def poisoned_cross_entropy(*args, **kwargs):
    loss = cross_entropy(*args, **kwargs)
    return loss * float("nan") if step in steps and int(os.environ["RANK"]) == rank else loss


train.DataLoader.next_batch = counting_next_batch
torch.nn.functional.cross_entropy = poisoned_cross_entropy
sys.exit(train.run(argv))
