"""The shared jobs made in the background (conftest.py) run at the lowest CPU priority, so that they take only the
cores the tests in front leave idle: a process of theirs, in a session of its own as torchrun's workers are, has nice
19, and so has its session's autogroup where the kernel groups processes by session. A test's own job made there
(made_later.py) that fails fails its own tests only."""

import os
import subprocess
import sys
import threading

import pytest

import made_later
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


def test_a_tests_own_job_fails_its_readers_alone_and_waits_for_no_shared_job(runs, tmp_path, monkeypatch):
    """The background thread makes it without raising (a raise would stop the thread, and every shared job after it
    would then fail its tests); the test that reads it gets the error, and another job is made as before, while the
    thread holds the shared jobs' lock (a test reading its own job must not wait for a shared one)."""
    def broken(folder):
        raise RuntimeError(f"no job in {folder.name}")

    monkeypatch.setitem(made_later.REGISTERED, "broken", broken)
    monkeypatch.setitem(made_later.REGISTERED, "fine", lambda folder: folder.name)
    shared = type(runs)(tmp_path)  # a session's SharedRuns of its own: this test holds its lock
    result, error = shared.make_own("broken")  # as the thread does
    assert result is None and str(error) == "no job in broken"
    with pytest.raises(RuntimeError, match="no job in broken"):
        shared.made("broken")
    made = []
    with shared.lock:  # as the thread holds it while it makes a shared job
        reader = threading.Thread(target=lambda: made.append(shared.made("fine")))
        reader.start()
        reader.join(timeout=10)
    assert made == ["fine"]
