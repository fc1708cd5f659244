"""Weights & Biases beside metrics.jsonl and TensorBoard: the same records, from the same rank, on W&B's pages.

Optional: `wandb` is not in requirements.txt, and `metrics.enable_wandb` without it is refused by `train.py --check`
in one line. The run is named as torchtitan names it, from the environment (`WANDB_PROJECT`, `WANDB_RUN_NAME`,
`WANDB_TEAM`, `WANDB_RUN_ID`, `WANDB_RUN_NOTES`, `WANDB_RUN_TAGS` (comma-separated), `WANDB_RUN_GROUP`,
`WANDB_RUN_JOB_TYPE`; `WANDB_MODE=offline` writes the run under the dump folder only), so a launcher sets them
without touching the config; its config is the job's resolved config.

It logs from the rank that writes metrics.jsonl (rank 0, which holds the true loss once it is all-reduced over the
loss mesh, under PP the last stage's). A resumed job continues the same run: its id is kept in
`<dump_folder>/wandb_run_id` and read back whenever the job resumes from a checkpoint. The x-axis is our `step`
field rather than W&B's own counter, which only grows: a job resumed after a crash logs again the steps between its
checkpoint and the crash, and W&B would drop every one of them as "in the past".
"""

from __future__ import annotations

import importlib.util
import logging
import os
import uuid

from torchtitan_lite.config import ConfigError

logger = logging.getLogger("torchtitan_lite")
ID_FILE = "wandb_run_id"


def check_wandb(enabled: bool) -> None:
    if enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.enable_wandb is set but wandb is not installed: pip install wandb "
                          "(requirements-dev.txt lists it) or pass --no-metrics.enable_wandb")


def run_id(dump_folder: str, resumed: bool, new_id) -> str:
    """WANDB_RUN_ID if set; else the id this folder's run was logged under when the job resumes; else a new one."""
    path = os.path.join(dump_folder, ID_FILE)
    chosen = os.environ.get("WANDB_RUN_ID")
    if not chosen and resumed and os.path.exists(path):
        with open(path) as f:
            chosen = f.read().strip()
    chosen = chosen or new_id()
    with open(path, "w") as f:
        f.write(chosen + "\n")
    return chosen


class WandbRun:
    def __init__(self, dump_folder: str, config: dict, start_step: int):
        import wandb  # noqa: PLC0415 - optional: only a run that asks for it needs it

        env = os.environ.get
        tags = [t.strip() for t in env("WANDB_RUN_TAGS", "").split(",") if t.strip()]
        self.run = wandb.init(
            entity=env("WANDB_TEAM"), project=env("WANDB_PROJECT", "torchtitan_lite"), name=env("WANDB_RUN_NAME"),
            id=run_id(dump_folder, start_step > 0, lambda: uuid.uuid4().hex[:8]), resume="allow", notes=env("WANDB_RUN_NOTES"),
            tags=tags or None, group=env("WANDB_RUN_GROUP"), job_type=env("WANDB_RUN_JOB_TYPE"), dir=dump_folder,
            config=config)
        self.run.define_metric("*", step_metric="step")
        logger.info("wandb: run %s (project %s)", self.run.id, self.run.project)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def close(self) -> None:
        self.run.finish()
