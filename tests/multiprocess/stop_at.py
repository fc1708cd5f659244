"""train.py with one rank that stops itself (SIGSTOP, as a hung or frozen process) at a named point of a step:

    stop_at.py RANK POINT TRAIN_ARGS...

POINT is one of the points runtime/flight_recorder.py names ("the forward of block 1", "a pipeline send/receive",
...); rank RANK stops the first time it reaches it once the training timeout is in force (from step 2 on), before the
collective that follows, so its peers wait on that collective."""

import os
import signal
import sys

import train
from torchtitan_lite.runtime import flight_recorder
from torchtitan_lite.runtime.process import train_timeout

stop_rank, stop_point, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
at = flight_recorder.at


def stopping_at(point: str) -> None:
    if point == stop_point and train_timeout() is not None and int(os.environ["RANK"]) == stop_rank:
        os.kill(os.getpid(), signal.SIGSTOP)
    at(point)


flight_recorder.at = stopping_at
sys.exit(train.run(argv))
