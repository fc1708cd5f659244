"""train.py under torchrun with its ranks out of step, as a loaded machine may schedule them.

    skewed_ranks.py RANK0_DELAY_S RANK1_EXTRA_ARGS TRAIN_ARGS...

Rank 0 starts RANK0_DELAY_S late, so the other ranks reach any verdict first; rank 1 alone also gets the
space-separated RANK1_EXTRA_ARGS, so it may have an error that rank 0 does not share.
"""

import os
import sys
import time

import train

delay, rank1_extra, argv = float(sys.argv[1]), sys.argv[2].split(), sys.argv[3:]
rank = int(os.environ["RANK"])
if rank == 0:
    time.sleep(delay)
sys.exit(train.run(argv + (rank1_extra if rank == 1 else [])))
