"""Checkpoints with torch.distributed.checkpoint (DCP): what a resume restores, when it is saved, how a save stays
atomic, and how a load stays safe.

A checkpoint is `<dump_folder>/<checkpoint.folder>/step-N/`: every rank writes its own shards (`__R_0.distcp`), then
the coordinator writes `.metadata`, which maps each tensor's global shape to the pieces. A load reads whichever pieces
its own shards overlap, so a checkpoint saved on one mesh loads on any other. Keys are `model.<param>`,
`optimizer.state.<param>.exp_avg` ..., `optimizer.param_groups.<param>.lr` ..., `lr_scheduler.*`,
`dataloader.position`, `train_state.*` and `rng.cpu` (`rng.cuda` on GPUs); a model-only checkpoint (seed, export)
holds the `model.*` keys alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from concurrent import futures
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan_lite.checkpoint.folder import (checkpoint_to_load, complete_checkpoints, read_run_files,
                                               steps_to_delete, write_run_files)
from torchtitan_lite.checkpoint.hf_load import load_hf
from torchtitan_lite.checkpoint.reader import SafePlanner, SafeReader, check_fits, flatten_state, read_metadata
from torchtitan_lite.checkpoint.states import FnState, TrainState, get_rng, model_state, set_rng
from torchtitan_lite.checkpoint.trash import Trash, finish_publishing, publish
from torchtitan_lite.config import Checkpoint, ConfigError, Model

logger = logging.getLogger("torchtitan_lite")

# Test hook: seconds the coordinator waits with every shard written and `.metadata` not yet, the moment at which a
# kill would do the most damage. Only the tests set it.
_PAUSE_BEFORE_METADATA_S = float(os.environ.get("TORCHTITAN_LITE_TEST_PAUSE_BEFORE_METADATA_S", "0"))


class _Writer(FileSystemWriter):
    def __init__(self, path: str, run: tuple[str, str] | None = None):
        super().__init__(path)
        self.run = run  # the run's id and config, written beside the shards before `.metadata` makes them complete

    def finish(self, metadata, results) -> None:  # runs on the coordinator only, after every rank has written
        if self.run is not None:
            write_run_files(str(self.path), *self.run)
        if _PAUSE_BEFORE_METADATA_S:
            logger.warning("test hook: pausing %.0fs before writing .metadata", _PAUSE_BEFORE_METADATA_S)
            time.sleep(_PAUSE_BEFORE_METADATA_S)
        super().finish(metadata, results)


def check_config(cfg: Checkpoint, world_size: int, dump_folder: str = "") -> None:
    """Checks run before any process talks to another: the options, that the folders a run writes can be written (a
    read-only or missing mount should stop the run now, not at its first save hours later), and what it would load."""
    for path, key in ((dump_folder, "job.dump_folder"), (os.path.join(dump_folder, cfg.folder), "checkpoint.folder")):
        if not dump_folder or (key == "checkpoint.folder" and not cfg.enable):
            continue
        try:
            os.makedirs(path, exist_ok=True)
            tempfile.TemporaryFile(dir=path).close()
        except OSError as e:
            raise ConfigError(f"{key}: cannot write to {path} ({e.strerror}): choose another folder or make it "
                              "writable") from None
    if cfg.create_seed_checkpoint and world_size > 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint runs on one process (got {world_size}): run with NGPU=1; "
                          "runs on any mesh then start from its step-0")
    if cfg.load_step >= 0 and not cfg.enable:
        raise ConfigError("checkpoint.load_step needs checkpoint.enable = true")
    if dump_folder and not cfg.create_seed_checkpoint:  # a seed run loads nothing
        checkpoint_to_load(cfg, os.path.join(dump_folder, cfg.folder))


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """Runs fn on rank 0 and hands every rank its result, or raises its error on every rank, so a rank never waits
    in a collective for a rank that gave up (and ranks never disagree about what a shared folder holds)."""
    outcome: list[Any] = [(None, None)]  # (error, value), broadcast in a list as torch asks
    if dist.get_rank() == 0:
        try:
            outcome[0] = (None, fn())
        except Exception as e:  # noqa: BLE001 - relayed to every rank and raised there
            outcome[0] = (e if isinstance(e, ConfigError) else RuntimeError(f"checkpoint, on rank 0: {e!r}"), None)
    dist.broadcast_object_list(outcome, src=0)
    # gloo (torch 2.13) may abort a process ("terminate called without an active exception") that exits while a
    # broadcast it sent is in flight, as rank 0 may right after an error or a finished run: wait for every rank.
    dist.barrier()
    error, value = outcome[0]
    if error is not None:
        raise error
    return value


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _global_shapes(state: dict[str, Any]) -> dict[str, Any]:
    """The state's keys as DCP names them, each tensor as a meta tensor of its global shape (small to send)."""
    return {k: torch.empty(v.shape, device="meta") if isinstance(v, torch.Tensor) else v
            for k, v in flatten_state(state).items()}


def _is_full(metadata: Metadata) -> bool:
    """Whether a checkpoint holds the whole training state, not weights only."""
    return any(k.startswith("train_state.") for k in metadata.state_dict_metadata)


class Writer:
    """Who saves: this job alone, always (a plain run). Replica groups answer for themselves (training/replicas.py)."""

    def may_write(self) -> bool:
        """Whether this job saves now; the same answer on every rank (collective where it must be)."""
        return True

    def tag(self) -> str | None:
        """The tag of this job's saves in progress (`step-N.TAG.tmp`): None, `step-N.tmp`, for a sole writer."""
        return None

    def holds(self) -> bool:
        """Whether this job still saves, asked on rank 0 before it publishes: a writer may have lost its claim."""
        return True

    def took_over(self, step: int) -> str | None:
        """At a step where this job became the writer: the tag of the writer before it (whose saves in progress
        are left over), "" for none; None at any other step."""
        return None


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the previous ones are intact."""


class CheckpointManager:
    """Saves (every `interval` steps and at the last step) and restores the run's whole state, atomically."""

    def __init__(self, cfg: Checkpoint, dump_folder: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Stateful, dataloader: Stateful, train_state: TrainState, update_guard: Stateful,
                 total_steps: int, model_name: str = Model.name):
        self.cfg, self.folder, self.total_steps = cfg, os.path.join(dump_folder, cfg.folder), total_steps
        self.model, self.train_state, self.model_name = model, train_state, model_name  # model.name: its HF adapter
        # Everything a resume restores, in one place.
        self.states: dict[str, Stateful] = {
            "model": model_state(model),
            # Keyed by parameter name, not index, so it maps onto any mesh and any wrapping; the param groups too, as
            # pipeline stages hold different parameters (a group's list of names would differ by stage).
            "optimizer": FnState(lambda: get_optimizer_state_dict(model, optimizer, options=_FLAT),
                                   lambda state: set_optimizer_state_dict(model, optimizer, state, options=_FLAT)),
            "lr_scheduler": lr_scheduler,  # after the optimizer: a changed schedule resets the lr it loads
            "dataloader": dataloader,  # a position in the global sample order: the same on every rank, any dp degree
            "train_state": train_state,
            "update_guard": update_guard,  # fp16's loss scale, skipped steps; empty unless fp16 or skipping
            "rng": FnState(get_rng, set_rng),
        }
        self._pending: tuple[Any, int, float] | None = None  # in-flight async save: (future, step, start time)
        # An async save runs its collectives from a background thread while training runs its own: a group of its
        # own keeps the two streams of messages apart, and gloo keeps it on the CPU where the staged copy lives. The
        # ranks agree on how it went over a second gloo group (_outcome), from the training thread.
        is_async = cfg.enable and cfg.async_mode == "async"
        self._group = dist.new_group(backend="gloo") if is_async else None
        self._control = dist.new_group(backend="gloo") if is_async else None
        self._trash, self._closed = Trash(), False
        # The run each save is labelled with (rank 0's: the run's id and config, set once its history is decided),
        # and what the checkpoint a resume loaded says of its own run: (id, config), None when older than run ids.
        self.run: tuple[str, str] | None = None
        self.resumed_run: tuple[str | None, str | None] = (None, None)
        # Whether and under which tag this job saves now: of a run's replica groups, the one that logs, while its
        # claim on the folder holds (replicas.py, runtime/fence.py); they hold the same state, and one writer keeps
        # the folder's checkpoints one sequence.
        self.writer: Writer = Writer()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        self.close(error)

    # ---- Load

    def load(self) -> int:
        """Resumes from the newest complete checkpoint in the folder (or checkpoint.load_step); when the folder holds
        none, starts from checkpoint.initial_load_path if set (a Hugging Face folder's weights with
        initial_load_in_hf: hf_load.py), never writing there. Sets train_state.step. Returns the step resumed from this
        folder's own checkpoint, 0 for a fresh start (run_history.py)."""
        plan = _on_rank0(self._plan)
        if plan is None:
            return 0
        if plan[1] == "hf":
            load_hf(self.model, plan[0], self.model_name)
            return 0
        path, what, step, metadata = plan
        resumed = step if os.path.dirname(path) == self.folder else 0  # not checkpoint.initial_load_path's
        if resumed and dist.get_rank() == 0:
            self.resumed_run = read_run_files(path)
        if what == "skip":
            self.train_state.step = step
            return resumed
        keys = ["model"] if what == "model" else list(self.states)
        t0 = time.perf_counter()
        state = {k: self.states[k].state_dict() for k in keys}  # templates: this rank's shards, any layout
        # Pipeline stages hold different keys: rank 0 checks them all, each with its global shape.
        shapes = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(_global_shapes(state), shapes, dst=0)
        _on_rank0(lambda: check_fits({k: v for rank in shapes for k, v in rank.items()}, path, metadata))
        # The metadata rank 0 read once, handed to every rank by _on_rank0: no rank reads .metadata again.
        dcp.load(state, storage_reader=SafeReader(path, metadata), planner=SafePlanner(allow_partial_load=True))
        for k in keys:
            self.states[k].load_state_dict(state[k])
        logger.info("loaded %s from %s in %.2fs: training continues after step %d", "weights" if what == "model"
                    else "full state", path, time.perf_counter() - t0, self.train_state.step)
        return resumed

    def _plan(self) -> tuple[str, str, int, Metadata | None] | None:
        """(path, "all" | "model" | "skip" | "hf", step, its metadata) of what to load, or None for a fresh start;
        rank 0 only."""
        cfg = self.cfg
        if cfg.enable and os.path.isdir(self.folder):
            finish_publishing(self.folder, self._trash)  # a publish a crash cut short: step-N before it is listed
        step, found, path = checkpoint_to_load(cfg, self.folder)
        if step is not None:
            if max(found) > step:
                logger.warning("resuming from step-%d although step-%d exists: a restart without checkpoint.load_step "
                               "will pick step-%d", step, max(found), max(found))
            if step >= self.total_steps:  # a finished run: nothing to load
                return found[step], "skip", step, None
            if _is_full(metadata := read_metadata(found[step])):
                return found[step], "all", step, metadata
            if step == 0:  # a seed checkpoint: initial weights only, by design
                return found[step], "model", 0, metadata
            raise ConfigError(f"{found[step]} holds weights only (checkpoint.last_save_model_only) and cannot be "
                              f"resumed: start a new run from it with checkpoint.initial_load_path")
        if not path:
            return None
        if cfg.initial_load_in_hf:
            return path, "hf", 0, None
        if not _is_full(metadata := read_metadata(path)) and not cfg.initial_load_model_only:
            raise ConfigError(f"checkpoint.initial_load_path {path} holds weights only: set "
                              "checkpoint.initial_load_model_only = true")
        return path, "model" if cfg.initial_load_model_only else "all", 0, metadata

    # ---- Save

    def maybe_save(self, step: int, last: bool = False) -> None:
        """Saves every checkpoint.interval steps and at the last step; call after each optimizer step."""
        if not self.cfg.enable:
            return
        if self._pending is not None and self._outcome(block=False)[0]:
            self.wait()  # publish a finished async save now rather than at the next save
        if last and self.cfg.last_save_model_only:
            self.save(step, model_only=True, dtype=getattr(torch, self.cfg.export_dtype))
        elif last or step % self.cfg.interval == 0 or self._catch_up(step):
            self.save(step)

    def _catch_up(self, step: int) -> bool:
        """At a step where this job became the run's writer (replica groups): whether the writer before it left the
        run before it saved the last interval step it committed, so that this job saves now (a catch-up save)
        rather than leave the run's newest checkpoint an interval older. Its saves in progress go."""
        previous = self.writer.took_over(step)
        if previous is None:
            return False

        def newest() -> int:
            if previous:
                self._trash.discard_tagged(self.folder, previous)
            return max(complete_checkpoints(self.folder), default=0)

        due = step // self.cfg.interval * self.cfg.interval
        if _on_rank0(newest) >= due:
            return False
        logger.info("checkpoint step-%d: a catch-up save, the writer before this replica group having left the run "
                    "before it saved step-%d", step, due)
        return True

    def save(self, step: int, model_only: bool = False, dtype: torch.dtype | None = None) -> None:
        """Writes step-N: the full state, or with model_only the weights alone (cast to dtype). Collective."""
        self.wait()  # one save in flight at a time
        if not self.writer.may_write():
            return
        tag = self.writer.tag()
        tmp = os.path.join(self.folder, f"step-{step}{f'.{tag}' if tag else ''}.tmp")
        if dist.get_rank() == 0:
            os.makedirs(self.folder, exist_ok=True)
            self._trash.sweep(self.folder, tag)  # a crashed save's or deletion's leftovers
        dist.barrier()  # no rank writes into step-N.tmp before rank 0 has moved an old one away
        states = {"model": model_state(self.model, dtype)} if model_only else self.states
        t0 = time.perf_counter()
        if self._group is None:
            try:
                dcp.save(states, storage_writer=_Writer(tmp, self.run))
            except CheckpointException as e:
                return self._failed(step, tmp, e)
            self._publish(step, tmp, t0)
        else:
            result = dcp.async_save(states, storage_writer=_Writer(tmp, self.run), process_group=self._group)
            # Newer torch may answer with a pair of futures; the upload one means "written".
            self._pending = (getattr(result, "upload_completion", result), step, t0, tmp)
            logger.info("checkpoint step-%d: training blocked %.2fs while the state was copied; writing in the "
                        "background", step, time.perf_counter() - t0)

    def _outcome(self, block: bool) -> tuple[bool, BaseException | None]:
        """(ended on every rank, its error if it failed on any) of the in-flight async save: the same verdict on every
        rank. Each rank's future completes at its own moment, and a rank that raised at its own step would leave the
        others waiting in the next collective: one small all-reduce makes every rank publish, raise or train on at the
        same step. Collective; with `block`, after the save has ended here."""
        future = self._pending[0]
        if block:
            futures.wait([future])
        done = future.done()  # asked once: it may turn true meanwhile
        error = future.exception() if done else None
        flags = torch.tensor([not done, error is not None], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._control)
        if flags[1] and error is None:
            error = RuntimeError("another rank's save failed")
        return not flags[0], error

    def wait(self, exiting_on: BaseException | None = None) -> None:
        """Blocks until an in-flight async save is written, then publishes it; a failed one is cleared, never
        published. Exiting on an error, each rank goes by its own future, without a collective (a peer may be gone):
        rank 0's has succeeded only once every rank has written, and its step was healthy when it was staged."""
        if self._pending is None:
            return
        future, step, t0, tmp = self._pending
        if exiting_on is None:
            error = self._outcome(block=True)[1]
        else:
            futures.wait([future])
            error = future.exception()
        self._pending = None
        if error is not None:
            return self._failed(step, tmp, error, exiting_on)
        self._publish(step, tmp, t0)

    def close(self, exiting_on: BaseException | None = None) -> None:
        """Every way out of a run ends here (the manager is a context manager): an in-flight async save is waited
        for, then rank 0 finishes its deletions. After the other ranks' barrier, so none waits on them."""
        if self._closed:
            return
        try:
            self.wait(exiting_on)
            if exiting_on is None:
                dist.barrier()  # DCP's save ends with a broadcast: the exit gloo may abort on, as in _on_rank0
        finally:
            self._closed = True
            self._trash.wait()

    def _failed(self, step: int, tmp: str, error: BaseException, exiting_on: BaseException | None = None) -> None:
        """A save that failed on some rank (a full disk, a lost mount), which every rank learns at the same step,
        after every rank stopped writing. Its step-N.tmp goes, so the folder holds the complete checkpoints it held
        before; then the run stops, or with checkpoint.continue_on_save_error goes on and tries again at the next
        save. A run already ending on another error reports that one. A replica group that lost its claim on the
        folder meanwhile (its save in progress discarded by the new writer) stands down instead."""
        if exiting_on is None and not self.writer.may_write():
            return
        if dist.get_rank() == 0 and os.path.isdir(tmp):
            with contextlib.suppress(OSError):  # a lost mount: the next save's sweep tries again
                self._trash.discard(tmp)
        where, cause = "", error  # another rank's failure, or this rank's outside DCP's own handling
        if isinstance(error, CheckpointException):
            rank, (cause, _) = next(iter(error.failures.items()))
            where = f" on rank {rank}"
        newest = max(complete_checkpoints(self.folder), default=None)
        free = shutil.disk_usage(self.folder).free / 2**30
        message = (f"saving checkpoint step-{step} failed{where} ({free:.1f} GiB free in {self.folder}): "
                   f"{str(cause).strip().splitlines()[0][:200]}; "
                   + (f"step-{newest} is intact" if newest is not None else "no earlier checkpoint exists"))
        if exiting_on is not None:
            logger.error("%s", message)
        elif not self.cfg.continue_on_save_error:
            raise CheckpointSaveError(f"{message}: make room in {self.folder} (or set checkpoint.folder) and rerun to "
                                      "resume, or set checkpoint.continue_on_save_error to train on")
        else:
            logger.error("%s: training goes on (checkpoint.continue_on_save_error)", message)

    def _publish(self, step: int, tmp: str, t0: float) -> None:
        """Renames step-N.tmp to step-N (trash.publish), then applies keep_latest_k; rank 0 only, after DCP's save has
        returned there, which is after every rank has written. DCP alone writes `.metadata` last, so a fresh folder
        is never seen half-written; the temporary name adds that a save over an existing step-N (a run resumed from
        an older step) never mixes new shards with the old `.metadata`, and that readers (eval jobs, scripts) never
        see a step-N still being written. What goes is deleted in the background (trash.py)."""
        final = os.path.join(self.folder, f"step-{step}")
        if dist.get_rank() == 0:
            if not self.writer.holds():  # a replica group stopped while it saved: the new writer saves instead
                with contextlib.suppress(OSError):
                    self._trash.discard(tmp)
                return
            publish(tmp, self._trash)
            found = complete_checkpoints(self.folder)
            for s in steps_to_delete(list(found), self.cfg.keep_latest_k, step):
                self._trash.discard(found[s])
        logger.info("saved checkpoint %s in %.2fs", final, time.perf_counter() - t0)
