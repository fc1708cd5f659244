"""What shaped a run's past windows, saved with the loader's position, so that a resume which would silently replay or
skip windows is refused with one line naming what changed.

The position alone resumes the order only if the order of the steps done is the same: the global batch and the
quotas of a mixture's past phases (data/mixture.py), each source's windows per epoch (its files, seq_len), whether
validation holds out every HOLDOUT-th window of the training files (which changes the windows that train), and
training.seed, which keys every seeded source's order (each epoch's permutation, the synthetic stream): under another
seed the same position reads other windows, so a resumed run would train some twice and others never. A source
whose order the seed does not key (an hf stream) records none. Future phases are not in it: they may be edited. A
checkpoint saved before digests existed has none and loads; one saved before they held the seed is not checked for it.
"""

from __future__ import annotations

import json
from typing import Any

from torchtitan_lite.config import ConfigError


def digest(source, step: int) -> str:
    """The digest of the steps before `step`, as saved: JSON, readable in the checkpoint."""
    if hasattr(source, "digest"):
        shape = source.digest(step)
    else:
        shape = {"sources": {"": part_digest(source)}, **({"seed": source.seed} if hasattr(source, "seed") else {})}
    return json.dumps(shape, sort_keys=True)


def part_digest(source) -> dict[str, Any]:
    """What shapes a plain source's order: its windows per epoch, and whether validation holds out part of them."""
    return {"windows": getattr(source, "n", None), "held_out": getattr(source, "part", "all") == "train"}


def check_digest(saved: str, source, step: int) -> None:
    """Refuses, in one line naming what changed, a resume whose data would not continue the saved past."""
    was, now = json.loads(saved), json.loads(digest(source, step))
    fix = "resume with the data settings the checkpoint was saved with, or start a new run in another dump folder"
    if ("quotas" in was) != ("quotas" in now):
        raise ConfigError(f"the checkpoint trained on {'a mixture' if 'quotas' in was else 'one dataset'} and this "
                          f"config gives {'a mixture' if 'quotas' in now else 'one dataset'}: {fix}")
    if was.get("global_batch") != now.get("global_batch"):
        raise ConfigError(f"the checkpoint's mixture dealt global batches of {was.get('global_batch')} windows, this "
                          f"run's are {now.get('global_batch')}: the past per-source counts would change; keep "
                          f"training.global_batch_size as it was")
    if was.get("quotas") != now.get("quotas"):
        raise ConfigError(f"the mixture's past changed: the {step} steps saved drew {_quotas(was)} windows per batch, "
                          f"this config gives them {_quotas(now)}; edit only phases that start at step {step} or "
                          f"later, or {fix}")
    for name, part in was.get("sources", {}).items():
        new = now.get("sources", {}).get(name)
        label = f"source {name!r}" if name else "the training data"
        if new is None:
            raise ConfigError(f"{label} trained in the saved steps but is gone from this config: {fix}")
        if part["held_out"] != new["held_out"]:
            raise ConfigError(f"validation {'held out' if part['held_out'] else 'did not hold out'} every 50th window "
                              f"of {label} when the checkpoint was saved, and {'does not' if part['held_out'] else 'does'}"
                              f" now, which changes the windows it trains on: resume with validation.enable as it "
                              f"was, or give the validation data a path of its own")
        if part["windows"] != new["windows"]:
            raise ConfigError(f"{label} held {part['windows']} windows per epoch when the checkpoint was saved and "
                              f"{new['windows']} now: its files or training.seq_len changed; {fix}")
    if "seed" in was and "seed" in now and was["seed"] != now["seed"]:  # last: a changed source is named above
        raise ConfigError(f"the checkpoint was trained with training.seed {was['seed']} and this run has "
                          f"{now['seed']}: the seed keys the data order, so the saved position would read other "
                          f"windows and train some twice and others never; resume with --training.seed {was['seed']}, "
                          f"or start a new run in another dump folder")


def _quotas(digest: dict[str, Any]) -> str:
    return "; ".join(f"from step {start}: " + ", ".join(f"{n} {c}" for n, c in named.items())
                     for start, named in digest.get("quotas", [])) or "no mixture"
