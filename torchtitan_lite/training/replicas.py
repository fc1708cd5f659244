"""Replica groups: one run as several torchrun jobs that outlive each other's failures (fault_tolerance.*).

Each group is a job of its own with any layout this file allows inside; together the groups are the run's outermost
data-parallel dimension, as HSDP's replicas are, except that a group may die and come back while the others train on.
torchft (optional, as torchao is) does what it does well: its lighthouse tells the groups each step who is alive (the
quorum), its process group across the groups is rebuilt for each new membership, and a group behind the others is
sent their state. The rest is here:
- The step's samples are the global batch's, whoever is alive: a group's data-parallel rank and size come from the
  quorum (its rank among the live groups, their number), so the survivors of a failure take the missing group's
  micro-batches and every step trains the same samples as an uninterrupted run (the loader's slice is a function of
  its position, rank and size: data/loader.py). Fast mode fixes each group's share by its replica_id instead: a
  missing group's is skipped (and named in the log record), and the sums scaled to the mean of the samples trained.
- Gradients are summed across the groups, as the step's loss scale expects (step.py: summed across ranks): one flat
  all-reduce of every gradient's local shard, the layouts being alike in every group (never a DTensor: torchft's
  collective has no sharding rule for one, and swallows the error).
- A step is applied only if the group's vote (torchft's should_commit) says that every collective of it succeeded;
  otherwise nothing of it is kept and it is trained again, on the same samples, by whoever is alive then.
- The quorum is synchronous: torchft's asynchronous one reads the serving group's state from its own thread while
  FSDP holds unsharded parameters in forward, and crashed there (benchmarks/results/2026-11-28_torchft_groups.md).
- A group behind the others (restarted, or one whose vote failed where theirs passed) loads everything a
  checkpoint holds from a live group (checkpoint.manager's states: weights, optimizer, schedule, loss scale, RNG,
  data position, step) before its next step, which it then trains with them: its first gradient is a real one
  (replica_state.py: each tensor's local shard travels).

The first of the live groups logs each step and saves the checkpoints, which any run resumes, with groups or
without (their state is the same in every group); the run keeps one history (Replicas says how). A signal to any
group stops them all after the same step: the step's all-reduce carries each group's agreement on signals
(signals.py) too. A group may be any layout but HSDP's (whose replicate dimension the groups are): check_replicas.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan_lite.checkpoint.manager import TrainState
from torchtitan_lite.config import ConfigError, FaultTolerance, JobConfig
from torchtitan_lite.data.loader import DataLoader
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.quantization import float8
from torchtitan_lite.runtime.metric_logger import last_step
from torchtitan_lite.runtime.replica_launcher import RESTARTED
from torchtitan_lite.runtime.signals import Preemption
from torchtitan_lite.training import replica_state

logger = logging.getLogger("torchtitan_lite")

STARTED = time.time()  # when this job started (train.py imports this module at once): behind_the_run's


def check_replicas(cfg: JobConfig, dims: ParallelDims, global_batch: int, moe: bool) -> int:
    """The run's global batch with replica groups, or a ConfigError for what they cannot do yet. It must split into
    whole micro-batches over any number of live groups from min_replica_size to group_size; -1 is the smallest that
    does (with 2 groups: a micro-batch per data-parallel rank of each)."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return global_batch
    if ft.replica_id >= ft.group_size:
        raise ConfigError(f"fault_tolerance.replica_id {ft.replica_id} must be below fault_tolerance.group_size "
                          f"{ft.group_size}: number the groups 0 to {ft.group_size - 1}")
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(f"fault_tolerance.min_replica_size {ft.min_replica_size} is more than the "
                          f"{ft.group_size} groups (fault_tolerance.group_size): no step could ever commit")
    if not (ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise ConfigError("fault_tolerance.enable needs the torchft lighthouse's address: set "
                          "fault_tolerance.lighthouse http://HOST:PORT or TORCHFT_LIGHTHOUSE")
    try:
        _import_torchft()
    except ImportError:
        raise ConfigError("fault_tolerance.enable needs torchft: pip install torchft==0.2.0") from None
    unsupported = {"parallelism.data_parallel_replicate_degree": dims.dp_replicate > 1,
                   "checkpoint.create_seed_checkpoint": cfg.checkpoint.create_seed_checkpoint,
                   "compile.enable": cfg.compile.enable,
                   "float8.enable_float8_linear": float8.enabled(cfg), "a mixture-of-experts flavor": moe,
                   f"training.dataset {cfg.training.dataset}": cfg.training.dataset in ("mixture", "hf"),
                   "validation.enable": cfg.validation.enable,
                   # Each group would write its own files under the same names, or a curve of its own.
                   "metrics.enable_tensorboard": cfg.metrics.enable_tensorboard,
                   "metrics.enable_wandb": cfg.metrics.enable_wandb,
                   "profiling.enable_profiling": cfg.profiling.enable_profiling,
                   "profiling.enable_memory_snapshot": cfg.profiling.enable_memory_snapshot}
    if refused := [k for k, on in unsupported.items() if on]:
        raise ConfigError(f"replica groups (fault_tolerance.enable) train FSDP, TP, PP and CP layouts of a dense "
                          f"model on random-access data, without validation or traces so far: turn off "
                          f"{', '.join(refused)}")
    per_group = cfg.training.local_batch_size * dims.dp
    # Exact mode: whole micro-batches for any count of live groups; fast mode: for every group, each its own share.
    counts = [ft.group_size] if ft.mode == "fast" else range(ft.min_replica_size, ft.group_size + 1)
    whole = per_group * math.lcm(*counts)
    batch = whole if cfg.training.global_batch_size == -1 else global_batch
    for live in counts:
        if batch % (per_group * live):
            raise ConfigError(f"training.global_batch_size {batch} does not split into whole micro-batches over "
                              f"{live} {'' if ft.mode == 'fast' else 'live '}groups of local_batch_size "
                              f"{cfg.training.local_batch_size} x data-parallel degree {dims.dp}: use a multiple of "
                              f"{whole}")
    return batch


def restarts() -> int:
    """How many times this group has been started again: by its torchrun (MAX_RESTARTS), or as a whole by
    run_train.sh's REPLICA_GROUPS mode (runtime/replica_launcher.py)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + int(os.environ.get(RESTARTED, "0"))


def behind_the_run(folder: str, step: int, started: float) -> bool:
    """Whether another group logged steps past `step` since this job started (at `started`): it left the run
    (finished, or died) before this group joined, whose steps and checkpoints would overwrite its. Records written
    before belong to a run stopped after its newest checkpoint, which a resume drops."""
    path = os.path.join(folder, "metrics.jsonl")
    return os.path.exists(path) and os.stat(path).st_mtime > started and (last_step(path) or 0) > step


def _import_torchft():
    """torchft (optional, as torchao is), quiet: its own logs say a few lines per step and rank (its Rust part reads
    RUST_LOG once, at import, and logs at INFO without it) and a failed collective's traceback, where this file says
    what happened in one line."""
    os.environ.setdefault("RUST_LOG", "error")
    import torchft  # noqa: PLC0415

    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)  # its receive of a state
    warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)
    return torchft


class NoReplicas:
    """A run of one group: every step is committed at its first attempt, and this job logs every one."""

    def join(self, history: Callable[[], None], adopt: Callable[[], None]) -> None:
        history()

    def writing(self) -> bool:
        return True

    def attempts(self, step: int) -> Iterator[None]:
        yield

    def reduce(self, losses: torch.Tensor) -> None:
        pass

    def commit(self) -> bool:
        return True

    def fields(self) -> dict[str, Any]:
        return {}

    def batches_trained(self) -> float | None:
        return None  # one a step

    def finish(self) -> None:
        pass


class Replicas:
    """This group's part in a run of replica groups (the module's docstring says how they train together).

    The step's record is written by the group that is first among the live ones (its quorum rank 0), so every
    committed step is logged once whoever has died meanwhile. The run's history (run_history.py) begins at its
    first committed step, in the group that logs it: a group that heals, or that committed a step beside the one
    that logged it, joins a history begun already and never begins another.
    """

    def __init__(self, cfg: FaultTolerance, group_rank: int, group_size: int, dp_rank: int, dp_size: int,
                 data: DataLoader, states: dict[str, Stateful], train_state: TrainState, params: list,
                 preemption: Preemption, resumable: bool, folder: str):
        torchft = _import_torchft()
        from torchft.checkpointing.pg_transport import PGTransport  # noqa: PLC0415 - optional

        self.cfg, self.data, self.states, self.train_state, self.params = cfg, data, states, train_state, params
        self.preemption, self.resumable, self.folder = preemption, resumable, folder  # resumable: checkpoints on
        self.group_rank, self.dp_rank, self.dp_size = group_rank, dp_rank, dp_size  # within the group
        self.live, self._rank = 0, None
        # Which groups trained the last attempt, then whether one was signalled (reduce); those of the last committed.
        self._marks, self._alive = torch.zeros(0), None
        self._committed, self._quorum_ready = False, False
        self._heal_error: Exception | None = None
        # Fast mode: each group's share of every global batch is its own; the windows of those missing from the steps
        # committed since the last log record ([first, end) in the data's order), which the next one lists.
        self.fast, self.skipped = cfg.mode == "fast", []
        self._batches = 0.0  # the global batches this group trained since the last log record: its share of each
        if self.fast:
            data.dp_rank, data.dp_size = cfg.replica_id * dp_size + dp_rank, cfg.group_size * dp_size
        self._history: Callable[[], None] | None = None  # begins the run's history, until it has one
        self._adopt: Callable[[], None] | None = None  # takes up a history another group began, as its writer
        timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
        pg = torchft.ProcessGroupGloo(timeout=timeout)
        # The state travels over the groups' own process group, from each rank to the same rank of the group behind.
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=self._load, state_dict=self._serve, min_replica_size=cfg.min_replica_size,
            use_async_quorum=False, quorum_timeout=timedelta(milliseconds=cfg.quorum_timeout_ms), rank=group_rank,
            world_size=group_size, replica_id=f"replica_{cfg.replica_id}",
            lighthouse_addr=cfg.lighthouse or None, checkpoint_transport=PGTransport(pg, timeout, torch.device("cpu")),
            init_sync=False)  # every group initializes alike (init.py)
        self.manager.load_state_dict({"step": train_state.step, "batches_committed": 0})

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    def writing(self) -> bool:
        """Whether this group logs the step: the first of the live groups."""
        return self._rank == 0

    # ---- Membership

    def _quorum(self) -> None:
        """Who is alive for the next attempt; a group behind the others loads their state first (_load)."""
        before, t0 = self.train_state.step, time.perf_counter()
        self.manager.start_quorum()
        self._heal_error = self.manager.errored()  # a heal whose sender died: this group is still behind
        live, self._rank = self.manager.num_participants(), self.manager.participating_rank()
        if live > self.cfg.group_size:
            raise ConfigError(f"{live} replica groups are alive, more than fault_tolerance.group_size "
                              f"{self.cfg.group_size}: give each group its own fault_tolerance.replica_id")
        if self.train_state.step != before:
            self._history = None
            logger.info("replica group %d healed from a live group in %.2fs: step %d -> %d", self.cfg.replica_id,
                        time.perf_counter() - t0, before, self.train_state.step)
        self.live = live
        if not self.fast:
            self.data.dp_rank, self.data.dp_size = self._rank * self.dp_size + self.dp_rank, live * self.dp_size

    def join(self, history: Callable[[], None], adopt: Callable[[], None]) -> None:
        """The first quorum, before the loop: a group that restarts comes back at the others' step. `history`
        begins the run's history, `adopt` takes up one begun by another group (rank 0's; no-ops elsewhere). A
        restarted group with no live group to heal from and no checkpoints stops: alone it would train the run again
        from its start (the others finished, or died as well)."""
        self._history, self._adopt = history, adopt
        self._quorum()
        self._quorum_ready = True
        restarted = restarts() > 0
        if restarted and self._history is not None and self.live == 1 and not self.resumable:
            raise ConfigError(f"replica group {self.cfg.replica_id} restarted and found no live group to heal from "
                              "(the others have finished, or died too): without checkpoints there is nothing to "
                              "rejoin; start the run again")
        if self._history is not None:
            behind = torch.tensor([float(behind_the_run(self.folder, self.train_state.step, STARTED))])
            dist.all_reduce(behind, op=ReduceOp.MAX, group=self.preemption.group)  # one answer: the file may grow
            if behind.item():
                raise ConfigError(f"replica group {self.cfg.replica_id} is behind the run: another group logged "
                                  f"steps past {self.train_state.step} since this one started, and none is alive to "
                                  "heal from (they have finished, or died): nothing to rejoin")

    def attempts(self, step: int) -> Iterator[None]:
        """Yields until every live group has committed `step`, each attempt on the same samples; none when a heal
        has already brought this group past it."""
        position = None
        while self.train_state.step < step:
            if not self._quorum_ready:
                if position is not None:
                    self.data.position = position  # the failed attempt's samples again
                self._quorum()
            self._quorum_ready = False
            if self.train_state.step >= step:  # healed from a group that committed it
                self._quorum_ready = True  # in the quorum of the step after its last: this group's next one
                return
            position = self.data.position
            yield
            if self._committed:
                return
            if self._heal_error is not None:
                logger.warning("replica group %d could not heal (%s): asking the groups alive now again",
                               self.cfg.replica_id, _why(self._heal_error))
            else:
                logger.warning("step %d was not committed (%s): training it again with the groups alive now", step,
                               _why(self.manager.errored()))

    # ---- The step

    def reduce(self, losses: torch.Tensor) -> None:
        """Sums the gradients' local shards and the step's losses across the live groups, in one all-reduce, with
        each group's mark (which groups trained the step) and its agreement on signals (whether it stops after it)."""
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.params
                 if p.grad is not None]
        mark = torch.zeros(self.cfg.group_size + 1, device=losses.device)
        mark[self.cfg.replica_id] = 1
        mark[-1] = self.preemption.vote()
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [losses.reshape(-1).float(), mark])
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        if self.fast and self.live < self.cfg.group_size:  # sums over the live groups' shares: their mean instead
            flat[: -mark.numel()] *= self.cfg.group_size / self.live
        offset = 0
        for t in [*grads, losses]:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        self._marks = flat[offset:]

    def commit(self) -> bool:
        """The group's vote: whether every collective of the step succeeded in every live group (Update's gate)."""
        self._committed = self.manager.should_commit()
        if self._committed:
            *marks, signalled = self._marks.tolist()  # read once: one copy from the device
            alive = [g for g, n in enumerate(marks) if n > 0.5]
            self._say_who_trained(alive)
            self._batches += 1 / (self.cfg.group_size if self.fast else len(alive))
            if self.fast:
                self._skip([g for g in range(self.cfg.group_size) if g not in alive])
            self.preemption.widen(signalled > 0.5)  # every group stops after the same step
            if self._history is not None:
                if self.writing():
                    self._history()  # the run's first committed step, which this group logs
                    self._adopt = None
                self._history = None  # else the group that logs it began it
            elif self._adopt is not None and self.writing():  # long begun: the file names the run
                self._adopt()
                self._adopt = None
        return self._committed

    def _skip(self, missing: list[int]) -> None:
        """Notes the committed step's windows that `missing` groups would have trained: theirs in fast mode."""
        share = self.data.global_batch // self.cfg.group_size
        first = self.data.position - self.data.global_batch  # the step's: the loader has moved past it
        for g in missing:
            start, end = first + g * share, first + (g + 1) * share
            if self.skipped and self.skipped[-1][1] == start:
                self.skipped[-1][1] = end
            else:
                self.skipped.append([start, end])

    def fields(self) -> dict[str, Any]:
        """The log record's: in fast mode, the windows skipped since the last record. Called at every logging step
        in every group (each sees every committed step), so any group that logs the next record lists the same."""
        if not self.fast:
            return {}
        skipped, self.skipped = self.skipped, []
        return {"skipped_samples": skipped}

    def batches_trained(self) -> float:
        """The global batches this group trained since the last call, at logging steps: its tokens per second."""
        batches, self._batches = self._batches, 0.0
        return batches

    def _say_who_trained(self, alive: list[int]) -> None:
        """Names the groups that left or joined since the last committed step; at this job's first one, those
        absent."""
        if self._alive is None:
            changes = [f"group {i} absent" for i in range(self.cfg.group_size) if i not in alive]
        else:
            changes = [f"group {i} left" for i in self._alive if i not in alive]
            changes += [f"group {i} joined" for i in alive if i not in self._alive]
        if changes:
            logger.warning("replica groups: %s; training with %s%s", ", ".join(changes),
                           ", ".join(str(i) for i in alive),
                           " (fast mode: a missing group's samples are skipped)" if self.fast and len(alive) <
                           self.cfg.group_size else "")
        self._alive = alive

    def finish(self) -> None:
        """Says, on every rank, the digest of its state: the same rank of every group must say the same."""
        logger.info("replica group %d rank %d ends at step %d, state digest %s", self.cfg.replica_id,
                    self.group_rank, self.train_state.step, replica_state.digest(self.states))

    # ---- Healing

    def _serve(self) -> dict[str, Any]:
        """What a group behind gets: every state a checkpoint holds, each tensor as this rank's local shard."""
        return {**{k: replica_state.local(s.state_dict()) for k, s in self.states.items()}, "skipped": self.skipped}

    def _load(self, received: dict[str, Any]) -> None:
        for k, s in self.states.items():
            s.load_state_dict(replica_state.filled(s.state_dict(), received[k]))
        self.skipped = [list(r) for r in received["skipped"]]  # the next record lists them, whichever group logs it


def _why(error: Exception | None) -> str:
    """A failed step's cause in a few words: gloo's first sentence, without its source location."""
    if error is None:
        return "fewer groups alive than fault_tolerance.min_replica_size"
    text = str(getattr(error, "original_exception", error)).splitlines()[0]
    return text.rsplit("] ", 1)[-1].split(". ")[0][:160]


def build_replicas(cfg: JobConfig, group_rank: int, group_size: int, dp_rank: int, dp_size: int, data: DataLoader,
                   states: dict[str, Stateful], train_state: TrainState, params: list, preemption: Preemption,
                   exits: contextlib.ExitStack) -> NoReplicas | Replicas:
    """The run's replica groups, chosen once at start-up."""
    if not cfg.fault_tolerance.enable:
        return NoReplicas()
    replicas = Replicas(cfg.fault_tolerance, group_rank, group_size, dp_rank, dp_size, data, states, train_state,
                        params, preemption, cfg.checkpoint.enable, cfg.job.dump_folder)
    exits.callback(replicas.close)
    return replicas
