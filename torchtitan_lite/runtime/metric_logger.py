"""The per-step metric logger.

It writes the two formats docs/configuration.md fixes ("What a run writes"): `metrics.jsonl` (what scripts and tests
read) and the console line `step: N  loss: X  ...` (torchtitan's shape). TensorBoard is optional and imported only
when enabled; it gets the run's resolved config as text, and a resumed run continues its curves without the stale
tail a crash leaves (see MetricLogger). W&B, optional too, gets the same records (wandb_run.py).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
import tomllib
from collections.abc import Callable

from torchtitan_lite.runtime.wandb_run import WandbRun

logger = logging.getLogger("torchtitan_lite")

_UNWRITTEN = 1000  # records a job keeps for the file at most: a replica group that never writes keeps no more


def _plain(v):
    """A tensor or numpy scalar as a Python number, so json.dumps writes it at full precision (repr); a list (fast
    replica groups' skipped_samples) as it is."""
    v = v.item() if hasattr(v, "item") else v
    return v if isinstance(v, (int, float, list)) else float(v)


# Console fields after `loss`, in order: key, label, format. Keys not in `values` are skipped.
_CONSOLE = [
    ("grad_norm", "grad_norm", "{:.4f}"),
    ("lr", "lr", "{:.4e}"),
    ("tps", "tps", "{:,.0f}"),
    ("mfu", "mfu", "{:.2f}%"),
    ("memory_gib", "memory", "{:.2f}GiB"),
]


def _moe(values: dict) -> list[str]:
    """A mixture of experts' fields, none for a dense model: its load in one number, the busiest expert's slots over
    the mean in the layer where that is worst (metrics.jsonl keeps every layer's, expert_load/<layer>), then its
    router losses where they are on (logged only then), before their coefficients, and with a capacity factor the
    fraction of the slots dropped."""
    loads = [v for k, v in values.items() if k.startswith("expert_load/")]
    fields = [f"load: {max(loads):.2f}"] if loads else []
    return fields + [f"{k}: {values[k]:.4f}" for k in ("aux_loss", "router_z_loss", "dropped") if k in values]


class Eta:
    """Time left, from the pace of the steps logged so far by this process. The first logged step's window holds the
    start-up and, compiled, the compilation: it is the estimate only until a second log gives the pace of steps
    alone, from then on measured from the first. Validation, checkpoints and logging are in the pace, as in the
    time left."""

    def __init__(self, start_step: int):
        self._first: tuple[int, float] = (start_step, time.perf_counter())
        self._from_first = False

    def __call__(self, step: int, total: int) -> float | None:
        now = time.perf_counter()
        first_step, first_time = self._first
        if total <= step or step <= first_step:
            return 0.0 if total and step >= total else None
        eta = (now - first_time) / (step - first_step) * (total - step)
        if not self._from_first:  # the first log: from now on, the pace is measured from this step
            self._first, self._from_first = (step, now), True
        return eta


def _clock(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def last_step(path: str) -> int | None:
    """The step of a metrics.jsonl's last complete record (a run's start or resume record included, not another
    event's: replica groups' claims, runtime/fence.py), if any."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
        for line in reversed(f.read().splitlines()):
            try:
                record = json.loads(line)
                if record.get("event") in (None, "start", "resume"):
                    return int(record["step"])
            except (ValueError, KeyError, TypeError, AttributeError):  # a torn first line of the tail, or no step
                continue
    return None


class MetricLogger:
    """Writes each logged step to metrics.jsonl, the console and optionally TensorBoard and W&B; rank 0 only."""

    def __init__(self, dump_folder: str, rank: int, log_freq: int, enable_tensorboard: bool, tb_folder: str, *,
                 start_step: int = 0, total_steps: int = 0, config: str = "", enable_wandb: bool = False,
                 writes: Callable[[], bool] = lambda: True, unwritten: list[dict] | None = None):
        """`start_step`: the step this run resumes after (0 for a fresh run); `total_steps`: training.steps, for the
        console's k/N and ETA; `config`: the resolved config as TOML, shown in TensorBoard's text tab and W&B's;
        `writes`: whether this job logs the step now (replica groups: the one group that does, replicas.py);
        `unwritten`: the records made and not yet in the file, which replica groups keep and send a group that heals
        (this logger adds to it and empties it in place)."""
        self.log_freq, self.total_steps, self.last, self.writes = log_freq, total_steps, {}, writes
        self._eta = Eta(start_step)
        self._path = None
        self._unwritten = [] if unwritten is None else unwritten  # oldest first (_append)
        self._behind = False
        self._tb = None
        self._wandb = None
        if rank != 0:  # every rank holds the same numbers after the all-reduce; one writer avoids duplicates
            return
        os.makedirs(dump_folder, exist_ok=True)
        # Appended to, from the first record on (replica groups begin the run's history only at their first step): a
        # resumed run continues the same file, which run_history.start_history has cut back to the checkpoint's step;
        # a fresh run finds it moved aside.
        self._path = os.path.join(dump_folder, "metrics.jsonl")
        if enable_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "metrics.enable_tensorboard is set but tensorboard is not installed: "
                    "`pip install tensorboard` or pass --no-metrics.enable_tensorboard"
                ) from e
            # A crash leaves events for the steps between the last checkpoint and the crash, which the resumed run
            # logs again. purge_step writes a restart marker at the first step this run logs, and TensorBoard drops
            # every earlier event at or past it: each curve stays one line, as metrics.jsonl keeps one record per
            # step. Not start_step itself: the earlier run's record of that step is still valid.
            self._tb = SummaryWriter(os.path.join(dump_folder, tb_folder), purge_step=start_step + 1)
            if config:
                # At this run's first step, not at 0: a resume with other settings (more steps) shows both configs
                # on the text tab's step slider, and a resume after a crash replaces the stale one with the scalars.
                self._tb.add_text("config", f"```toml\n{config}```", start_step + 1)
        if enable_wandb:
            self._wandb = WandbRun(dump_folder, tomllib.loads(config), start_step)

    def should_log(self, step: int, last: bool = False) -> bool:
        # Same answer on every rank, so the trainer can gate collectives (loss all-reduce) on it.
        return step == 1 or step % self.log_freq == 0 or last

    def log(self, step: int, values: dict[str, float]) -> None:
        if self._path is None:
            return
        values = {k: _plain(v) for k, v in values.items()}
        self.last.update(values, step=step)
        self._unwritten[:] = [r for r in self._unwritten if r["step"] != step] + [{"step": step, **values}]
        if step not in self._append():
            return
        eta = self._eta(step, self.total_steps)
        if "loss" in values:
            fields = [f"step: {step}/{self.total_steps}" if self.total_steps else f"step: {step}",
                      f"loss: {values['loss']:.4f}"]
            fields += [f"{label}: {fmt.format(values[k])}" for k, label, fmt in _CONSOLE if k in values]
            fields += _moe(values)
            fields += [f"mtp_loss: {values['mtp_loss']:.4f}"] if "mtp_loss" in values else []
            fields += [f"eta: {_clock(eta)}"] if eta is not None else []
            logger.info("  ".join(fields))
        if "val_loss" in values:  # a mixture's sources beside it (val_loss/NAME)
            sources = "".join(f"  {k}: {v:.4f}" for k, v in values.items() if k.startswith("val_loss/"))
            logger.info(f"step: {step}  val_loss: {values['val_loss']:.4f}{sources}")
        if self._tb is not None:
            for k, v in values.items():
                if not isinstance(v, list):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(step, values)

    def _append(self) -> list[int]:
        """Appends the records the file lacks, oldest first, if this job writes now (`writes`); the steps written.
        With replica groups these may be records of earlier steps beside this one's: every group keeps those it made
        until the file holds their steps, so a step whose writer left the run between its commit and its record (it
        died, or was stopped) is logged by the next writer. A record of a step the file holds already is dropped:
        another writer's, and a second would read as two runs spliced (run_history.read_history). Checked and
        written under an exclusive flock of the file, which a new writer's claim takes too (runtime/fence.py), so
        no record lands after a claim made meanwhile."""
        with open(self._path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when closed
            file_step = last_step(self._path)
            if file_step is not None:
                if self._unwritten[-1]["step"] <= file_step and not self._behind and self.writes():
                    logger.warning("metrics.jsonl already holds step %d: this job's records up to it are not "
                                   "written (it is behind the run)", file_step)
                    self._behind = True
                self._unwritten[:] = [r for r in self._unwritten if r["step"] > file_step]
            del self._unwritten[:-_UNWRITTEN]
            if not self._unwritten or not self.writes():
                return []
            f.writelines(json.dumps(r) + "\n" for r in self._unwritten)
            f.flush()  # readers (loss_compare, tests, a crashed run's post-mortem) see every step written
        written = [r["step"] for r in self._unwritten]
        self._unwritten.clear()
        if len(written) > 1:
            logger.warning("metrics.jsonl: the records of steps %s written by this job: the replica group that wrote "
                           "before it left the run before it logged them", ", ".join(map(str, written[:-1])))
        return written

    def close(self) -> None:
        self._path = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
