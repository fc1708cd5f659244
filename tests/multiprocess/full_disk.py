"""train.py on a disk that fills up during the save of step STEP: from then on rank RANK can write no file past
64 KiB. A file-size limit makes the kernel itself fail the writes (EFBIG rather than ENOSPC: the same path through
DCP and the trainer), on real files, with no mock. With `free`, the room comes back once that save is over. With
`late` (an async save), rank RANK sees the save end one check after it did, as a rank whose background thread lags
would. Each rank prints the step after which it learned of a failed save.

    full_disk.py RANK STEP [free|late] TRAIN_ARGS...
"""

import os
import resource
import signal
import sys

import train
from torchtitan_lite.checkpoint.manager import CheckpointManager

rank, step, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if sys.argv[3] in ("free", "late") else None
argv = sys.argv[4 if mode else 3:]
save, failed = CheckpointManager.save, CheckpointManager._failed


def seen_one_check_late(future) -> None:
    done, said_no = future.done, []

    def late() -> bool:
        if done() and not said_no:
            said_no.append(True)
            return False
        return done()

    future.done = late


def save_on_a_full_disk(self, at: int, *args, **kwargs):
    if at != step or int(os.environ["RANK"]) != rank:
        return save(self, at, *args, **kwargs)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails instead of killing the process
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        return save(self, at, *args, **kwargs)
    finally:
        if mode == "free":
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        if mode == "late" and self._pending is not None:
            seen_one_check_late(self._pending[0])


def failed_and_said_when(self, *args, **kwargs):
    print(f"full_disk.py: rank {os.environ['RANK']} learned of the failure after step {self.train_state.step}",
          flush=True)
    return failed(self, *args, **kwargs)


CheckpointManager.save = save_on_a_full_disk
CheckpointManager._failed = failed_and_said_when
sys.exit(train.run(argv))
