"""train.py with fp16's loss scale starting at 2**EXP instead of 2**16, so its first steps overflow and are skipped.

    fp16_overflow.py EXP TRAIN_ARGS...
"""

import functools
import sys

import torch

import train

exp, argv = int(sys.argv[1]), sys.argv[2:]
torch.amp.GradScaler = functools.partial(torch.amp.GradScaler, init_scale=2.0**exp)
sys.exit(train.run(argv))
