"""A replica group's torchrun output as REPLICA_GROUPS' launcher shows it: the workers' lines, without torchrun's
report of their failure.

When a worker of a group dies, its torchrun ends with about 30 lines of its own on stderr: its agent's log lines
("failed (exitcode: -9) local_rank: 0 ...", "Sending process N closing signal SIGTERM"), the traceback of the
ChildFailedError it raises, and a report framed by two rules of `=`. The launcher says the same in one line
(`replica group 0 failed (exit 1): starting it again ...`), and a run where groups fail and come back by design would
show torchrun's block between its own lines at every failure. So the launcher reads torchrun's stderr and passes on
everything but that block. The workers' own lines (torchrun's `--tee`, each prefixed `[groupN-rankM]:`) pass at once
and in order, a worker's traceback included; a traceback of torchrun's that is not a ChildFailedError (it could not
start the workers) is shown whole.
"""

from __future__ import annotations

import re
from typing import BinaryIO

_WORKER = re.compile(rb"^\[[A-Za-z][^\]\s]*\]:")  # a worker's line, as --tee prefixes it: [group0-rank0]:
# The agent's log lines about a failed worker (glog's form: level, date, time, pid, file:line]).
_AGENT = re.compile(rb"^[EW]\d{4} [\d:.]+ +\d+ \S+\] (failed \(exitcode|Sending process \d+ closing signal|"
                    rb"no error file defined for parent)")
_FAILED = b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError"


class Report:
    """Which of torchrun's lines to pass on, line by line."""

    def __init__(self):
        self.traceback: list[bytes] = []  # torchrun's traceback so far, held until its last line names it
        self.rules = -1  # within the failure report: its rules of `=` seen (-1: not in it)

    def feed(self, line: bytes) -> list[bytes]:
        """The lines to pass on now that `line` has come."""
        if _WORKER.match(line):
            return [line]
        if self.rules >= 0:  # the report: a rule opens it and another closes it
            self.rules += line.strip() != b"" and line.strip().strip(b"=") == b""
            if self.rules == 2:
                self.rules = -1
            return []
        if self.traceback:
            self.traceback.append(line)
            if line[:1].isspace():
                return []
            held, self.traceback = self.traceback, []
            if line.startswith(_FAILED):
                self.rules = 0
                return []
            return held
        if line.startswith(b"Traceback (most recent call last):"):
            self.traceback = [line]
            return []
        return [] if _AGENT.match(line) else [line]

    def end(self) -> list[bytes]:
        """What is held when the output ends: a traceback cut short is shown as it is."""
        held, self.traceback = self.traceback, []
        return held


def relay(src: BinaryIO, dst: BinaryIO) -> None:
    """Copies torchrun's stderr `src` to `dst` as Report passes it, line by line, until it ends. Should `dst` be
    closed (a pipe to `head`), it goes on reading: torchrun must never block on a full pipe."""
    report = Report()
    while True:
        line = src.readline()
        for out in report.feed(line) if line else report.end():
            try:
                dst.write(out)
                dst.flush()
            except (OSError, ValueError):
                pass
        if not line:
            src.close()
            return
