"""Deleting checkpoint folders off the training path.

Rank 0 deletes at a save (keep_latest_k's old checkpoints, a replaced step-N, a failed or crashed save's leftovers)
while the other ranks train on into their next collective. A multi-terabyte folder on a parallel filesystem takes
longer to delete than comm.train_timeout_seconds, so a delete on the training path would end the job as if rank 0
were hung. Rank 0 therefore only renames the folder (one metadata operation) to `step-N.<tag>.trash`, a name no
resume reads, and a thread of its own deletes it. The rename comes first because rmtree deletes in no particular
order: a half-deleted `step-N` that still held `.metadata` would look complete. The thread makes the rename durable
before it deletes anything under it, so a crash at any moment leaves either the whole `step-N` or a `.trash` folder,
which the next run's first save deletes (sweep).

A run that ends waits for its deletions (CheckpointManager.close), so the folder then holds what keep_latest_k keeps;
a process killed meanwhile leaves `.trash` folders behind, which is safe.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import threading

logger = logging.getLogger("torchtitan_lite")

_TMP = re.compile(r"step-\d+\.tmp")
_TRASH = re.compile(r"step-\d+(\.[0-9a-f]+)?\.trash")  # the tag keeps the names of two deletions of step-N apart


def fsync_dir(folder: str) -> None:
    """Makes the renames in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Trash:
    """Rank 0's deletions, one at a time, on a daemon thread started at the first one."""

    def __init__(self):
        self._queue: queue.Queue[str] = queue.Queue()
        self._listed: set[str] = set()  # queued or being deleted: a sweep must not queue them twice
        self._thread: threading.Thread | None = None

    def discard(self, path: str) -> None:
        """Renames the folder `path` out of sight and deletes it in the background."""
        self.delete(self.move_aside(path))

    @staticmethod
    def move_aside(path: str) -> str:
        """Renames the folder `path` to a trash name, which it returns."""
        trash = f"{path}.{os.urandom(4).hex()}.trash"
        os.rename(path, trash)
        return trash

    def delete(self, trash: str) -> None:
        """Deletes a folder move_aside named, in the background."""
        self._listed.add(trash)
        if self._thread is None:
            self._thread = threading.Thread(target=self._delete, name="checkpoint-trash", daemon=True)
            self._thread.start()
        self._queue.put(trash)

    def sweep(self, folder: str) -> None:
        """Discards what an earlier process left in `folder`: a save that never finished (`.tmp`), a deletion that
        never finished (`.trash`). Call when no save is in progress."""
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if _TMP.fullmatch(name):
                self.discard(path)
            elif _TRASH.fullmatch(name) and path not in self._listed:
                self.delete(path)

    def wait(self) -> None:
        """Returns once every deletion asked for is done."""
        if self._listed:
            logger.info("waiting for the deletion of %d checkpoint folder(s)", len(self._listed))
        self._queue.join()

    def _delete(self) -> None:
        while True:
            path = self._queue.get()
            try:
                fsync_dir(os.path.dirname(path))
                shutil.rmtree(path)
            except OSError as e:  # what is left is still trash: the next sweep tries again
                logger.warning("could not delete %s: %s", path, e)
            finally:
                self._listed.discard(path)
                self._queue.task_done()
