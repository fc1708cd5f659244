"""One live run per dump folder.

Two runs writing one folder splice their records into one metrics.jsonl and overwrite each other's checkpoints, and
nothing in either run's output says so. So rank 0 holds an exclusive lock on `<dump_folder>/run.lock` for the whole
run, and a second run into the folder is refused in one line before it writes anything (`train.py --check` and
run_train.sh ask first, so the second job starts no worker).

The lock is flock(2)'s: the kernel releases it when its holder exits, however it exits (SIGKILL, the OOM killer, a
lost node's lease on a network filesystem), so a dead run never leaves the folder locked and nobody deletes a stale
lock by hand. The file stays (deleting it would let two runs lock two different files under one name); what it holds
is only for the refusal's line: who holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time

from torchtitan_lite.config import ConfigError

LOCK = "run.lock"
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


def _try_lock(dump_folder: str, wait_s: float) -> int | None:
    """An open descriptor of the folder's lock file holding the lock, or None when a live run holds it."""
    os.makedirs(dump_folder, exist_ok=True)
    fd = os.open(os.path.join(dump_folder, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.05)


def check_free(dump_folder: str) -> None:
    """Refuses a folder a live run holds; holds nothing itself (train.py --check)."""
    fd = _try_lock(dump_folder, 0.0)
    if fd is None:
        raise _refusal(dump_folder, os.path.join(dump_folder, LOCK))
    os.close(fd)


@contextlib.contextmanager
def hold(dump_folder: str):
    """Holds the folder's lock for the duration (rank 0, before anything is written), or refuses in one line."""
    fd = _try_lock(dump_folder, _RETRY_S)
    if fd is None:
        raise _refusal(dump_folder, os.path.join(dump_folder, LOCK))
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock
