"""Renames in the checkpoint folder: publishing a save, and deleting checkpoint folders off the training path.

A save is written to `step-N.tmp` and published by renaming it to `step-N` (publish). A re-save of an existing step
takes two renames, the old `step-N` aside to a trash name and then the new one into place; a process killed between
them leaves the old copy in the trash and the new one complete under its temporary name. That name is what the folder's
rules then count as step N (folder.complete_checkpoints), and rank 0 renames it into place before it reads the folder
to resume or sweeps it (finish_publishing), so a crash at any moment of a publish leaves a complete step N that the
next run resumes from, never a sweep that deletes both copies: killed before the first rename, the old `step-N` stands
and the sweep discards the new copy; after it, the new one stands. A save whose `.metadata` was written (by then every
rank had written its shards) and whose process died before publishing it, an async one say, is published alike.

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

from torchtitan_lite.checkpoint.folder import complete_checkpoints

logger = logging.getLogger("torchtitan_lite")

_TMP = re.compile(r"step-\d+(?:\.([A-Za-z0-9]+))?\.tmp")  # TAG: a replica group's save (folder.py)
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

    def sweep(self, folder: str, tag: str | None = None) -> None:
        """Publishes the complete saves an earlier process left unpublished (finish_publishing), then discards what
        else it left in `folder`: a save that never finished or that a complete step-N supersedes (`.tmp`), a
        deletion that never finished (`.trash`). With a `tag` (a replica group's writer), only the saves tagged so:
        another group's may be in progress. Call when no save of this job is in progress."""
        finish_publishing(folder, self, tag)
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if (m := _TMP.fullmatch(name)) and tag in (None, m.group(1)):
                self.discard(path)
            elif _TRASH.fullmatch(name) and path not in self._listed:
                self.delete(path)

    def discard_tagged(self, folder: str, tag: str) -> None:
        """Discards the saves tagged `tag` in `folder`, complete or not: those of a replica group that has left the
        run (its claim was taken over), which it will not publish."""
        for name in sorted(os.listdir(folder)):
            if (m := _TMP.fullmatch(name)) and m.group(1) == tag:
                self.discard(os.path.join(folder, name))

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


def publish(tmp: str, trash: Trash) -> None:
    """Renames the complete save `tmp` (`step-N.tmp`, `step-N.TAG.tmp`) to `step-N`; an older `step-N` goes to `trash`
    first, and is deleted only once the new one is durably in place. A crash between the two renames leaves a
    folder that complete_checkpoints reads as the new step N and finish_publishing completes."""
    final = os.path.join(os.path.dirname(tmp), os.path.basename(tmp).split(".")[0])  # step-N.tmp, step-N.TAG.tmp
    old = trash.move_aside(final) if os.path.exists(final) else None
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final))  # the rename is durable before anything older is deleted
    if old:
        trash.delete(old)


def finish_publishing(folder: str, trash: Trash, tag: str | None = None) -> None:
    """Publishes each save in `folder` that was complete and never renamed into place (complete_checkpoints counts
    it under its `step-N.tmp` name); with a `tag`, only those tagged so. Rank 0, before it chooses what to resume or
    sweeps the folder."""
    for step, path in complete_checkpoints(folder).items():
        m = _TMP.fullmatch(os.path.basename(path))
        if m and tag in (None, m.group(1)):
            logger.warning("checkpoint %s is complete but was never published (its process ended before the "
                           "rename): publishing it as step-%d", path, step)
            publish(path, trash)
