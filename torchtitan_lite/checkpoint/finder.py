"""What the tools (scripts/generate.py, scripts/convert_to_hf.py) take as a checkpoint: the same argument for both, and
the run's config found beside it.

A run leaves `<dump_folder>/config.toml` and `<dump_folder>/<checkpoint.folder>/step-N`. A user holds one of those
three folders in hand, so each is accepted: a `step-N` folder is that checkpoint; a checkpoint folder, or a dump
folder, means its newest complete step, picked by checkpoint.complete_checkpoints as a resume picks it. The config is
then the one that wrote the checkpoint, which it holds (`step-N/config.toml`, resolved: the command line's overrides
too), so a checkpoint copied anywhere still has it; a checkpoint older than that holds none, and its dump folder's
`config.toml` stands in. The user may name another. The commonest miss is a run trained without
`--checkpoint.enable` (the debug config's default): it is named as such in one line, instead of a complaint about a
missing `.metadata` in a folder that does not exist.
"""

from __future__ import annotations

import os
from typing import Sequence

from torchtitan_lite.checkpoint.folder import complete_checkpoints
from torchtitan_lite.config import Checkpoint, ConfigError, JobConfig, load_config


def find_checkpoint(path: str, folder: str = Checkpoint.folder) -> tuple[str, str]:
    """(checkpoint, dump folder of its run) for `path`: a folder holding DCP's `.metadata`, else the newest complete
    step-N in `path`, else in `path/folder` (`path` is then a dump folder); ConfigError when there is none."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path, os.path.dirname(os.path.dirname(os.path.abspath(path)))
    for where, dump in ((path, os.path.dirname(os.path.abspath(path))), (os.path.join(path, folder), path)):
        found = complete_checkpoints(where)
        if found:
            return found[max(found)], dump
    why = "it does not exist" if not os.path.exists(path) else f"neither it nor {folder}/ in it holds a complete step-N"
    raise ConfigError(f"no checkpoint in {path}: train with --checkpoint.enable ({why}; give a step-N folder, the "
                      "folder holding them, or the run's dump folder)")


def checkpoint_and_config(path: str, config: str | None = None,
                          overrides: Sequence[str] = ()) -> tuple[str, JobConfig]:
    """The checkpoint `path` names (see find_checkpoint) and its run's config: `config` if given, else the one the
    checkpoint holds, else its dump folder's, with `--section.key value` overrides applied."""
    beside = config or os.path.join(path, "config.toml")  # a dump folder's names the checkpoint folder
    cfg = load_config(["--job.config_file", beside, *overrides]) if os.path.isfile(beside) else None
    checkpoint, dump = find_checkpoint(path, cfg.checkpoint.folder if cfg else Checkpoint.folder)
    if config is None:
        configs = [c for c in (os.path.join(checkpoint, "config.toml"), os.path.join(dump, "config.toml"))
                   if os.path.isfile(c)]
        if not configs:
            raise ConfigError(f"no config for {checkpoint}: it holds none (saved before checkpoints held their "
                              "config), nor does its dump folder, two levels above it; pass --config FILE")
        cfg = load_config(["--job.config_file", configs[0], *overrides])
    return checkpoint, cfg
