"""Who may write a replica-group run's folder: the writing group's claim, which a group that was frozen finds taken.

Replica groups (training/replicas.py) have one writer, the first of the live groups, and it changes when a group
leaves or joins. A group stopped right after it committed a step (SIGSTOP, a cgroup freeze, a VM migration, a swap
storm) still believes it writes when it wakes, and its save and its log record would land beside the new writer's:
its sweep deleting their save in progress, its record of an older step after theirs. So writing is fenced:
- A group that becomes the writer (at the first step it commits in a membership of its own) claims the folder by
  appending an event record to metrics.jsonl: `{"event": "groups", "step": S, "writer": G, "token": T, ...}`, also
  the record of who trained the run when. T names the claim (the group and its quorum id: a quorum is a membership,
  so a new writer always has a new one) and tags the writer's checkpoint saves in progress (`step-N.T.tmp`).
- Before each durable write (a record appended, a save begun, a save published) the writer checks that the newest
  claim in the file is still its own (`holds`): reading only what was appended since it last looked. One that finds
  another's stands down with one line and never touches another's save; its sweep removes its own `.tmp` folders
  alone. A record is checked and appended under an exclusive flock of the file, as a claim is appended, so no record
  lands after a claim made between the check and the write.
- "Behind the run" (a restarted group alone, whose checkpoint is older than what the others went on to log) is
  decided by the file: whether records past the group's step were appended (or the file replaced) since the group
  started, compared by inode and size, not by clocks.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os

from torchtitan_lite.runtime.metric_logger import last_step

logger = logging.getLogger("torchtitan_lite")

METRICS = "metrics.jsonl"
EVENT = '"event": "groups"'  # how a claim's line reads (json.dumps' spacing): lines without it are not parsed


@contextlib.contextmanager
def locked(path: str):
    """`path` opened for appending and reading, under an exclusive flock (held for a few writes, never longer)."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield f
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _claims(text: str) -> list[dict]:
    found = []
    for line in text.splitlines():
        if EVENT in line:
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return found


def file_state(folder: str) -> tuple[int, int] | None:
    """(inode, size) of the folder's metrics.jsonl, None when there is none: what `behind` compares."""
    with contextlib.suppress(OSError):
        st = os.stat(os.path.join(folder, METRICS))
        return st.st_ino, st.st_size
    return None


def behind(folder: str, step: int, at_start: tuple[int, int] | None) -> bool:
    """Whether another group logged steps past `step` since this job started (`at_start`: the file's state then): it
    went on without this group, which would train its steps again over its records and checkpoints. A file unchanged
    since then holds a stopped run's records, which a resume drops."""
    now = file_state(folder)
    if now is None or now == at_start:
        return False
    return (last_step(os.path.join(folder, METRICS)) or 0) > step


class Fence:
    """This group's claim on the folder as the run's writer; rank 0 of a group reads and writes it."""

    def __init__(self, folder: str):
        self.path = os.path.join(folder, METRICS)
        self.token: str | None = None
        self._seen: tuple[int, int] | None = None  # (inode, offset) of the file read so far, its claims all ours
        self.superseded: dict | None = None  # the claim that took over from ours

    def claim(self, step: int, token: str, event: dict) -> str | None:
        """Claims the folder for this group at `step` (its record in the file, `event` its fields); returns the token
        of the claim before it (the previous writer's: its saves in progress are left over), None for none."""
        with locked(self.path) as f:
            f.seek(0)
            earlier = _claims(f.read())
            f.write(json.dumps({"event": "groups", "step": step, **event, "token": token}) + "\n")
            f.flush()
            self.token, self.superseded = token, None
            self._seen = (os.fstat(f.fileno()).st_ino, f.tell())
        return earlier[-1]["token"] if earlier else None

    def holds(self) -> bool:
        """Whether the newest claim in the file is still this group's (call it under `locked` when the answer gates
        a write to the file itself)."""
        if self.token is None or self.superseded is not None:
            return False
        try:
            with open(self.path, "rb") as f:
                ino = os.fstat(f.fileno()).st_ino
                if self._seen is None or ino != self._seen[0]:  # replaced: another group began the history anew
                    self.superseded = {}
                    return False
                f.seek(self._seen[1])
                read = f.read()
        except OSError:
            return False
        read = read[: read.rfind(b"\n") + 1]  # whole lines: a line being appended is read next time
        taken = [c for c in _claims(read.decode(errors="replace")) if c.get("token") != self.token]
        if taken:
            self.superseded = taken[-1]
            return False
        self._seen = (ino, self._seen[1] + len(read))
        return True

    def stand_down(self, group: int) -> None:
        """Says, once per claim lost, that this group writes nothing more of the run (until it claims it again)."""
        if self.superseded is None or self.superseded.get("said"):
            return
        taken = dict(self.superseded)
        self.superseded["said"] = True
        who = (f"group {taken['writer']} took over at step {taken['step']}" if "writer" in taken else
               "another group began the run's history anew")
        logger.warning("replica group %d stands down as the run's writer: %s while this one was stopped; it writes no "
                       "record or checkpoint until it writes for the run again", group, who)
