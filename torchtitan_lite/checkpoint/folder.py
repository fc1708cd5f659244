"""The checkpoint folder's rules, pure functions of its listing: which `step-N` are complete, which one a run
resumes from, which keep_latest_k deletes. The trainer, `train.py --check` and the tools read a folder through them
alike."""

from __future__ import annotations

import json
import os
import re

from torchtitan_lite.config import Checkpoint, ConfigError

# A save in progress is `step-N.tmp`, or `step-N.TAG.tmp` when replica groups save (TAG: the writer's claim,
# runtime/fence.py).
_STEP = re.compile(r"step-(\d+)((?:\.[A-Za-z0-9]+)?\.tmp)?")
# Beside DCP's files in each step-N: the id of the run that saved it (runtime/run_history.py) and that run's config,
# so a checkpoint says whose it is and how it was made, wherever it is copied.
RUN, CONFIG = "run.json", "config.toml"


def write_run_files(path: str, run: str, config: str) -> None:
    """Writes the run's id and config into a checkpoint folder being saved (before DCP's `.metadata`, which makes it
    complete)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, RUN), "w") as f:
        json.dump({"run": run}, f)
    with open(os.path.join(path, CONFIG), "w") as f:
        f.write(config)


def read_run_files(path: str) -> tuple[str | None, str | None]:
    """(the id of the run that saved the checkpoint at `path`, its config as TOML); None for what a checkpoint older
    than run ids lacks."""
    run = config = None
    try:
        with open(os.path.join(path, RUN)) as f:
            run = str(json.load(f)["run"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        with open(os.path.join(path, CONFIG)) as f:
            config = f.read()
    except OSError:
        pass
    return run, config


def complete_checkpoints(folder: str) -> dict[int, str]:
    """step -> path of each complete checkpoint in `folder`, oldest first: a `step-N` folder holding DCP's
    `.metadata`, which exists only once every rank's shards are written (DCP writes it last, through a rename).

    A `step-N.tmp` (or `step-N.TAG.tmp`) holding `.metadata` where no complete `step-N` is counts too: a save every
    rank finished whose publishing rename never happened (a crash before it, or between the two renames of a
    re-save: trash.publish). The next run's rank 0 renames it into place before it lists or sweeps the folder
    (trash.finish_publishing), and a read-only listing (`train.py --check`, the tools) finds the same step here. Any
    other `step-N.tmp` (a save in progress, or one a complete `step-N` supersedes) and `step-N.<tag>.trash` (a
    deletion in progress) never match."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    matches = [m for m in map(_STEP.fullmatch, names) if m]
    found = {}
    for m in sorted(matches, key=lambda m: m.group(2) is None):  # each step-N.tmp first: a complete step-N wins
        if os.path.isfile(os.path.join(folder, m.group(0), ".metadata")):
            found[int(m.group(1))] = os.path.join(folder, m.group(0))
    return dict(sorted(found.items()))


def checkpoint_to_load(cfg: Checkpoint, folder: str) -> tuple[int | None, dict[int, str], str]:
    """(the step a run resumes from, None for none; the complete checkpoints in `folder`, read only with
    checkpoint.enable; checkpoint.initial_load_path if it resumes from none), each checked to exist."""
    found = complete_checkpoints(folder) if cfg.enable else {}
    if cfg.load_step >= 0 and cfg.load_step not in found:
        raise ConfigError(f"checkpoint.load_step {cfg.load_step}: {folder}/step-{cfg.load_step} is not a complete "
                          f"checkpoint (complete ones: {', '.join(f'step-{s}' for s in found) or 'none'})")
    path = "" if found else cfg.initial_load_path
    # A DCP checkpoint, or with initial_load_in_hf a Hugging Face folder (checkpoint/hf_load.py checks the rest).
    marker = "config.json" if cfg.initial_load_in_hf else ".metadata"
    if path and not os.path.isfile(os.path.join(path, marker)):
        why = ("does not exist" if not os.path.exists(path) else
               "has no config.json (not a Hugging Face folder)" if cfg.initial_load_in_hf else
               "has no .metadata (not a complete DCP checkpoint)" + (
                   ": it holds config.json, so set checkpoint.initial_load_in_hf if it is a Hugging Face folder"
                   if os.path.isfile(os.path.join(path, "config.json")) else ""))
        raise ConfigError(f"checkpoint.initial_load_path {path} {why}")
    return (cfg.load_step if cfg.load_step >= 0 else max(found, default=None)), found, path


def steps_to_delete(steps: list[int], keep_latest_k: int, just_saved: int) -> list[int]:
    """What keep_latest_k removes: all but the newest k, and never the checkpoint just saved, which is not the newest
    when a run resumed from an older one (checkpoint.load_step). 0 keeps everything."""
    keep = set(sorted(steps)[-keep_latest_k:]) | {just_saved} if keep_latest_k > 0 else set(steps)
    return [s for s in sorted(steps) if s not in keep]
