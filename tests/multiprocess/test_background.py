"""The shared jobs made in the background (conftest.py) run at the lowest CPU priority, so that they take only the
cores the tests in front leave idle: a process of theirs, in a session of its own as torchrun's workers are, has nice
19, and so has its session's autogroup where the kernel groups processes by session."""

import os
import subprocess
import sys

from launch import TRAIN, in_background, torchrun_cmd

PRIORITY = ("import os; print(os.nice(0)); "
            "print(open('/proc/self/autogroup').read().split()[-1] if os.path.exists('/proc/self/autogroup') else 19)")


def priority(env: dict[str, str]) -> list[str]:
    """(nice, autogroup nice) of a Python process started with `env` in a session of its own."""
    proc = subprocess.run([sys.executable, "-c", PRIORITY], env=env, start_new_session=True, capture_output=True,
                          text=True, check=True)
    return proc.stdout.split()


def test_a_job_started_in_the_background_takes_the_lowest_priority():
    with in_background():
        _, env = torchrun_cmd(2, TRAIN)
    assert priority(env) == ["19", "19"]
    _, env = torchrun_cmd(2, TRAIN)  # outside: the tests' own priority
    assert priority(env)[0] == str(os.nice(0))
