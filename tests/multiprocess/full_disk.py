"""train.py on a disk that fills up during the save of step STEP: from then on rank RANK can write no file past
64 KiB. A file-size limit makes the kernel itself fail the writes (EFBIG rather than ENOSPC: the same path through
DCP and the trainer), on real files, with no mock. With `free`, the room comes back once that save is over.

    full_disk.py RANK STEP [free] TRAIN_ARGS...
"""

import os
import resource
import signal
import sys

import train
from torchtitan_lite.checkpoint import CheckpointManager

rank, step, free = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "free"
argv = sys.argv[4 if free else 3:]
save = CheckpointManager.save


def save_on_a_full_disk(self, at: int, *args, **kwargs):
    if at != step or int(os.environ["RANK"]) != rank:
        return save(self, at, *args, **kwargs)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails instead of killing the process
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        return save(self, at, *args, **kwargs)
    finally:
        if free:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


CheckpointManager.save = save_on_a_full_disk
sys.exit(train.run(argv))
