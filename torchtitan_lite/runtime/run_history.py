"""One dump folder, each run's history whole: what a run does with the metrics.jsonl, config.toml, tb/ and
wandb_run_id it finds there, and how every reader reads metrics.jsonl.

Every run has an id, written in the first record of its metrics.jsonl (`{"event": "start", "run": ID, ...}`) and in
every checkpoint it saves (checkpoint/manager.py), so a folder's files always say which run they belong to:
- A run starting afresh (no checkpoint of its own: step 0, or another run's via checkpoint.initial_load_path) gets a
  new id and begins a new history. The folder's earlier history is moved aside, never deleted, as metrics.N.jsonl,
  config.N.toml, tb.N and wandb_run_id.N (the next free N): rerunning a command neither splices two runs into one
  curve nor loses the first, which stays comparable (`loss_compare.py metrics.1.jsonl ...`).
- A run resuming from a checkpoint continues the history of the run that saved it, wherever that history is: the
  folder's current one, or one moved aside since (a fresh run without checkpoints trained in the folder meanwhile),
  which then becomes current again while the other is moved aside. Records past the checkpoint's step S were logged
  by that run after S and then lost with it; the resumed run logs those steps again, so they are dropped, and a
  resume record `{"event": "resume", "run": ID, "step": S, ...}` marks the seam. Every step appears once.
- config.toml is the current run's config; each checkpoint holds the config that wrote it, and a resume record names
  what changed since (`"changed": {"training.steps": [10, 15]}`).
A folder older than run ids (no id in its checkpoint or its history) is taken as one run, as it always was.
Only the standard library here: the scripts that read metrics.jsonl need no torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import tomllib

logger = logging.getLogger("torchtitan_lite")

METRICS, CONFIG, WANDB_ID = "metrics.jsonl", "config.toml", "wandb_run_id"


class HistoryError(ValueError):
    """A metrics.jsonl that is not one run's history: not JSON lines, or two runs' records spliced together."""


def read_history(path: str | os.PathLike) -> tuple[list[dict], list[dict]]:
    """(step records, resume records) of a metrics.jsonl, or of a dump folder holding one; steps ascending, each
    once. A resume at step S drops the records past S before it (the trainer drops them from the file itself; a
    file joined by hand may hold them: the resumed run's record of a step wins). A step going back without a resume
    record, or a second run's start record, is two runs spliced: refused. Lines without a step, and records of other
    events, are not step records."""
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
            elif record.get("event") == "start" and (records or resumes):
                raise HistoryError(f"{path}:{lineno}: a second run starts here: two runs' records in one file; split "
                                   "it into one file per run")
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


def new_run_id() -> str:
    """A run's id: when it started, and enough randomness that two runs started in one second differ."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"


def history_run(path: str | os.PathLike) -> str | None:
    """The id of the run whose history `path` (a metrics.jsonl, or a dump folder holding one) is: the last one its
    records name; None for a file older than run ids, or none at all."""
    path = os.path.join(path, METRICS) if os.path.isdir(path) else os.fspath(path)
    run = None
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                if '"run"' in line:  # only the start and resume records name it: the step records are not parsed
                    try:
                        run = str(json.loads(line)["run"])
                    except (ValueError, KeyError, TypeError):  # torn by a crash
                        pass
    return run


def start_history(dump_folder: str, resumed_step: int, resumed_run: str | None, config: str, tb_folder: str,
                  world_size: int, checkpoint_config: str | None = None) -> str:
    """Makes the folder's history this run's, before its first record, and returns this run's id. `resumed_step` is
    the step of this folder's own checkpoint the run resumed from (0 for a fresh start), `resumed_run` the id that
    checkpoint names (None if it is older than run ids), `config` this run's resolved config as TOML and
    `checkpoint_config` the checkpoint's. Rank 0, once, holding the folder's lock (run_lock.py)."""
    os.makedirs(dump_folder, exist_ok=True)
    files = [os.path.join(dump_folder, name) for name in (METRICS, CONFIG, tb_folder, WANDB_ID)]
    metrics = files[0]
    if resumed_step == 0:
        run = new_run_id()
        _set_aside(files)
        with open(metrics, "w") as f:
            f.write(json.dumps({"event": "start", "run": run, "step": 0, "world_size": world_size}) + "\n")
    else:
        run = resumed_run or new_run_id()  # a checkpoint older than run ids: its run gets one from here on
        if history_run(metrics) != resumed_run:  # both None: a folder older than run ids, one run as it always was
            _set_aside(files)
            if resumed_run and (n := _numbered_history(dump_folder, resumed_run)) is not None:
                for p in files:
                    if os.path.exists(_numbered(p, n)):
                        os.replace(_numbered(p, n), p)
                logger.info("run %s's history (%s) is this folder's %s again: the checkpoint is that run's",
                            run, os.path.basename(_numbered(metrics, n)), METRICS)
            else:
                logger.warning("the history of run %s, whose checkpoint this run resumes, is not in %s: %s starts at "
                               "the resume from step %d", run, dump_folder, METRICS, resumed_step)
        resume = {"event": "resume", "run": run, "step": resumed_step, "world_size": world_size}
        if changed := config_changes(checkpoint_config, config):
            resume["changed"] = changed
        dropped = _truncate(metrics, resumed_step, resume)
        if dropped:
            logger.info("%s: %d records past step %d dropped (logged after the checkpoint, logged again now)", metrics,
                        dropped, resumed_step)
    with open(files[1], "w") as f:
        f.write(config)
    return run


def config_changes(before: str | None, after: str) -> dict[str, list]:
    """{"section.key": [before, after]} for each key whose value differs between two resolved configs (TOML)."""
    if not before:
        return {}
    old, new = _flat(tomllib.loads(before)), _flat(tomllib.loads(after))
    return {k: [old.get(k), new.get(k)] for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}


def _flat(table: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in table.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def _set_aside(files: list[str]) -> None:
    """Moves the folder's current history (metrics, config, tb, wandb id) under the next free number, if it holds
    anything of a run's: records of steps, or TensorBoard events (a run that logged nothing leaves nothing to keep)."""
    metrics, tb = files[0], files[2]
    if not _has_steps(metrics) and not (os.path.isdir(tb) and os.listdir(tb)):
        for p in (metrics, files[1]):
            if os.path.isfile(p):
                os.remove(p)
        return
    n = 1
    while any(os.path.exists(_numbered(p, n)) for p in files):
        n += 1
    moved = [p for p in files if os.path.exists(p)]
    for p in moved:
        os.replace(p, _numbered(p, n))
    logger.warning("earlier run's %s moved to %s: this folder's %s is this run's",
                   "/".join(map(os.path.basename, moved)),
                   "/".join(os.path.basename(_numbered(p, n)) for p in moved), METRICS)


def _has_steps(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return any('"event"' not in line and line.strip() for line in f)


def _numbered_history(folder: str, run: str) -> int | None:
    """N of the metrics.N.jsonl that is run `run`'s history, if one is."""
    found = [int(m.group(1)) for m in map(re.compile(r"metrics\.(\d+)\.jsonl").fullmatch, os.listdir(folder)) if m]
    return next((n for n in sorted(found, reverse=True)
                 if history_run(os.path.join(folder, f"metrics.{n}.jsonl")) == run), None)


def _numbered(path: str, n: int) -> str:
    """metrics.jsonl -> metrics.N.jsonl, config.toml -> config.N.toml, tb -> tb.N, wandb_run_id -> wandb_run_id.N."""
    root, ext = os.path.splitext(path.rstrip(os.sep))
    return f"{root}.{n}{ext}"


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
