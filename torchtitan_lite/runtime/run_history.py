"""One dump folder, one run's history: what a run does with the metrics.jsonl, config.toml and tb/ it finds there,
and how every reader reads metrics.jsonl.

A folder holds one run, however often it was stopped and resumed, so that a curve read from it is one run's curve:
- A run resuming from this folder's checkpoint at step S continues the history. Records past S were logged after
  that checkpoint by a run that then stopped without saving; the resumed run logs those steps again, so they are
  dropped, and a resume record `{"event": "resume", "step": S, ...}` marks the seam. Every step appears once.
- A run starting afresh (no checkpoint of its own: step 0, or another run's via checkpoint.initial_load_path) begins
  a new history. The earlier one is moved aside, never deleted, as metrics.N.jsonl, config.N.toml and tb.N (the next
  free N): rerunning a command (the README's reproduce command, a preempted run without checkpoints) neither splices
  two runs into one curve nor loses the first, which stays comparable (`loss_compare.py metrics.1.jsonl ...`).
- config.toml is the current run's; a resume under another config keeps the earlier one as config.step-S.toml.
Only the standard library here: the scripts that read metrics.jsonl need no torch.
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("torchtitan_lite")

METRICS, CONFIG = "metrics.jsonl", "config.toml"


class HistoryError(ValueError):
    """A metrics.jsonl that is not one run's history: not JSON lines, or two runs' records spliced together."""


def read_history(path: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """(step records, resume records) of a metrics.jsonl, or of a dump folder holding one; steps ascending, each
    once. A resume at step S drops the records past S before it (the trainer drops them from the file itself; a
    file joined by hand may hold them: the resumed run's record of a step wins). A step going back without a resume
    record is two runs spliced: refused. Lines without a step, and records of other events, are not step records."""
    path = os.path.join(path, METRICS) if os.path.isdir(path) else os.fspath(path)
    records, resumes, last = [], [], None
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise HistoryError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
            if not isinstance(record, dict) or "step" not in record:
                continue
            try:
                step = int(record["step"])
            except (TypeError, ValueError):
                raise HistoryError(f"{path}:{lineno}: step is not a number") from None
            if record.get("event") == "resume":
                while records and records[-1]["step"] > step:
                    records.pop()
                resumes.append(record)
            elif "event" in record:
                continue
            elif last is not None and step <= last:
                raise HistoryError(f"{path}:{lineno}: step {step} after step {last} with no resume record between: "
                                   "two runs' records in one file; split it into one file per run")
            else:
                records.append({**record, "step": step})
            last = step
    return records, resumes


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The step records of a metrics.jsonl or a dump folder: each step once, ascending (read_history)."""
    return read_history(path)[0]


def start_history(dump_folder: str, resumed_step: int, config: str, tb_folder: str, world_size: int) -> None:
    """Makes the folder's history this run's, before its first record: `resumed_step` is the step of this folder's
    own checkpoint the run resumed from, 0 for a fresh start; `config` the resolved config as TOML. Rank 0, once."""
    os.makedirs(dump_folder, exist_ok=True)
    metrics, config_path = os.path.join(dump_folder, METRICS), os.path.join(dump_folder, CONFIG)
    if resumed_step == 0:
        _move_aside(metrics, config_path, os.path.join(dump_folder, tb_folder))
    else:
        resume = {"event": "resume", "step": resumed_step, "world_size": world_size}
        if os.path.isfile(config_path) and _read(config_path) != config:
            resume["earlier_config"] = _free_name(dump_folder, f"config.step-{resumed_step}", ".toml")
            os.replace(config_path, os.path.join(dump_folder, resume["earlier_config"]))
        dropped = _truncate(metrics, resumed_step, resume)
        if dropped:
            logger.info("%s: %d records past step %d dropped (logged after the checkpoint, logged again now)", metrics,
                        dropped, resumed_step)
    with open(config_path, "w") as f:
        f.write(config)


def _move_aside(metrics: str, config: str, tb: str) -> None:
    """A fresh start into a folder holding an earlier run's records: that run's files get the next free number."""
    if not (os.path.isfile(metrics) and os.path.getsize(metrics)) and not (os.path.isdir(tb) and os.listdir(tb)):
        return  # no earlier history (a lone config.toml is a run that logged nothing)
    n = 1
    while any(os.path.exists(_numbered(p, n)) for p in (metrics, config, tb)):
        n += 1
    moved = [p for p in (metrics, config, tb) if os.path.exists(p)]
    for p in moved:
        os.replace(p, _numbered(p, n))
    logger.warning("earlier run's %s moved to %s: this folder's %s is this run's",
                   "/".join(map(os.path.basename, moved)),
                   "/".join(os.path.basename(_numbered(p, n)) for p in moved), METRICS)


def _numbered(path: str, n: int) -> str:
    """metrics.jsonl -> metrics.N.jsonl, config.toml -> config.N.toml, tb -> tb.N."""
    root, ext = os.path.splitext(path.rstrip(os.sep))
    return f"{root}.{n}{ext}"


def _free_name(folder: str, stem: str, ext: str) -> str:
    name, n = stem + ext, 1
    while os.path.exists(os.path.join(folder, name)):
        n += 1
        name = f"{stem}.{n}{ext}"
    return name


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _truncate(path: str, step: int, resume: dict) -> int:
    """Rewrites metrics.jsonl as its lines up to `step`, then the resume record; returns how many lines went. Written
    to a temporary file and renamed over the old one, so a crash leaves the old file or the new one, whole."""
    kept, dropped = [], 0
    if os.path.isfile(path):
        for line in _read(path).splitlines(keepends=True):
            try:
                keep = json.loads(line)["step"] <= step
            except (json.JSONDecodeError, KeyError, TypeError):  # a line torn by a crash, or a blank one
                keep = False
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += bool(line.strip())
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
        f.write(json.dumps(resume) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return dropped
