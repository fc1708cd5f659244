"""A test's own job that it only reads once made: a whole command run as a user runs it (the README's tours,
gpu_report.py), or a job of runs nothing else reads (the reference curve's layouts). None depends on timing or
signals, so conftest.py makes them in its background thread after the shared jobs, at the lowest CPU priority, on
the cores the tests in front leave idle while they wait on faults and timeouts; each reading test runs last, with the
tests that read the shared jobs, and makes its job itself when no background thread did.

A test module registers its job at import: `register(name, make)`, where `make(folder)` runs it in a new folder of
its own and returns what the test reads (launch.command_env gives a command the background's priority). The module
marks its tests `reads(name)`; the `made` fixture returns the result. What `make` raises is raised to the tests
that read that job, never to another's.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

REGISTERED: dict[str, Callable[[Path], Any]] = {}


def register(name: str, make: Callable[[Path], Any]) -> None:
    REGISTERED[name] = make
