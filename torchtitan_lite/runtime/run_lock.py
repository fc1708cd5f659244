"""One live run per dump folder.

Two runs writing one folder splice their records into one metrics.jsonl and overwrite each other's checkpoints, and
nothing in either run's output says so. So rank 0 holds an exclusive lock on `<dump_folder>/run.lock` for the whole
run, and a second run into the folder is refused in one line before it writes anything (`train.py --check` and
run_train.sh ask first, so the second job starts no worker).

The lock is flock(2)'s: the kernel releases it when its holder exits, however it exits (SIGKILL, the OOM killer, a
lost node's lease on a network filesystem), so a dead run never leaves the folder locked and nobody deletes a stale
lock by hand. The file stays (deleting it would let two runs lock two different files under one name); what it holds
is only for the refusal's line: who holds it.

Two run_train.sh started a moment apart both pass their checks before either job's rank 0 exists. So the script
takes the lock itself once its check has passed (`python -m torchtitan_lite.runtime.run_lock FD FOLDER` locks the
file the script opened as FD: a flock belongs to the open file, which the script keeps until it ends) and tells the
job's rank 0 so (LAUNCHER_HOLDS): the second script is refused in one line before it starts a worker.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time

from torchtitan_lite.config import ConfigError

LOCK = "run.lock"
LAUNCHER_HOLDS = "TORCHTITAN_LITE_LAUNCHER_HOLDS"  # the folder whose lock the launcher holds for this job
# A check (run_train.sh's, of another job) holds the lock for a moment to see whether it is free: the run that
# starts meanwhile waits that moment out rather than taking the check for a live run.
_RETRY_S = 2.0


def _holder(path: str) -> str:
    """What the lock file says about the run that holds it, for the error line."""
    try:
        with open(path) as f:
            held = json.load(f)
        return f"pid {held['pid']} on {held['host']}, since {held['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _refusal(dump_folder: str, path: str) -> ConfigError:
    return ConfigError(f"job.dump_folder {dump_folder} is in use by a live run ({_holder(path)}): wait for it to end, "
                       "or give this run a folder of its own (--job.dump_folder)")


def _flock(fd: int, wait_s: float, shared: bool = False) -> bool:
    """Locks the open file `fd`, waiting up to `wait_s` for another holder to let go; whether it did. A shared lock
    is held beside other shared ones (a run's replica groups) and refused to an exclusive one, as it refuses them."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _open(dump_folder: str) -> int:
    os.makedirs(dump_folder, exist_ok=True)
    return os.open(os.path.join(dump_folder, LOCK), os.O_RDWR | os.O_CREAT, 0o644)


def _say_holder(fd: int, pid: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": pid, "host": socket.gethostname(),
                              "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)


def check_free(dump_folder: str, shared: bool = False) -> None:
    """Refuses a folder a live run holds; `shared`, a replica group's check, is refused only by a run that is not
    replica groups. Holds and creates nothing itself (train.py --check: a refused config leaves no folder behind)."""
    try:
        fd = os.open(os.path.join(dump_folder, LOCK), os.O_RDWR)
    except FileNotFoundError:
        return  # no run has held it
    try:
        if not _flock(fd, 0.0, shared):
            raise _refusal(dump_folder, os.path.join(dump_folder, LOCK))
    finally:
        os.close(fd)


@contextlib.contextmanager
def hold(dump_folder: str, shared: bool = False):
    """Holds the folder's lock for the duration (rank 0, before anything is written), or refuses in one line; the
    replica groups of one run hold it `shared`. A job whose launcher holds it for the job (LAUNCHER_HOLDS) holds it
    already."""
    if os.environ.get(LAUNCHER_HOLDS) == os.path.abspath(dump_folder):
        yield
        return
    fd = _open(dump_folder)
    try:
        if not _flock(fd, _RETRY_S, shared):
            raise _refusal(dump_folder, os.path.join(dump_folder, LOCK))
        _say_holder(fd, os.getpid())
        yield
    finally:
        os.close(fd)  # releases the lock


if __name__ == "__main__":  # run_train.sh: lock the file it opened as FD, for as long as it keeps it open
    fd, folder, shared = int(sys.argv[1]), sys.argv[2], sys.argv[3:4] == ["1"]  # FD FOLDER [SHARED]
    if not _flock(fd, _RETRY_S, shared):
        print(f"error: {_refusal(folder, os.path.join(folder, LOCK))}", file=sys.stderr)
        sys.exit(2)
    _say_holder(fd, os.getppid())
