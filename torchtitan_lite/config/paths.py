"""Where a relative path resolves: a path typed on the command line, from the directory it was typed in.

run_train.sh changes into the repository, so that the configs' own relative paths (train_configs/..., the project's
tokenizer) resolve there whatever directory it is started from; a path the user types, though, means a file seen
from where they stand. The script records that directory in CALLER_DIR before it moves, and the loader (job_config.py)
makes the relative values of path options given on the command line absolute against it (against the working
directory when something else launched us, which is then the same place). config.toml then names files a rerun
finds from anywhere. Values read from a TOML file keep resolving against the working directory, as the configs here
expect.

cache_dir() is the one folder the package writes outside a run's dump folder: what it makes once per machine.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any, Iterable

CALLER_DIR = "TORCHTITAN_LITE_CALLER_DIR"
ONE, LIST = "one", "list"  # sections.py's opt(path=...): a file or folder; comma-separated files, globs or folders


def absolute(path: str) -> str:
    """`path`, `~` expanded, made absolute against the caller's directory (an absolute one is kept)."""
    base = os.environ.get(CALLER_DIR) or os.getcwd()
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def resolve_typed_paths(cfg: Any, options: Iterable[Any]) -> None:
    """Makes the values of `options` (job_config.py's path options that the command line set) absolute against the
    caller's directory."""
    for o in options:
        section = getattr(cfg, o.section)
        value = getattr(section, o.name)
        if not value or (o.path == LIST and getattr(section, "dataset", "") == "hf"):
            continue  # "": no file (byte-level tokenizer, built-in data); hf: a dataset name on the Hub
        parts = [p.strip() for p in value.split(",")] if o.path == LIST else [value]
        setattr(section, o.name, ",".join(absolute(p) for p in parts if p))


def cache_dir() -> Path:
    """What is made once per machine (tokenized corpora, the init's compiled fill): $TORCHTITAN_LITE_CACHE, else
    $XDG_CACHE_HOME/torchtitan_lite."""
    if os.environ.get("TORCHTITAN_LITE_CACHE"):
        return Path(os.environ["TORCHTITAN_LITE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchtitan_lite"


def cpu_identity() -> str:
    """What tells CPUs apart for what cache_dir() keeps per machine: their model and instruction sets (a cache shared
    by nodes of one CPU model is shared on purpose)."""
    try:
        with open("/proc/cpuinfo") as f:
            keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")
            return "".join(sorted({line for line in f if line.startswith(keys)}))
    except OSError:  # not Linux
        return platform.processor()
