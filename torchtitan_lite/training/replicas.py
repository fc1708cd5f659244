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
(signals.py) too. A group may be any layout but HSDP's (whose replicate dimension the groups are): replica_config.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan_lite.checkpoint.manager import TrainState, Writer
from torchtitan_lite.config import ConfigError, FaultTolerance, JobConfig
from torchtitan_lite.data.loader import DataLoader, group_share
from torchtitan_lite.runtime import flight_recorder
from torchtitan_lite.runtime.fence import behind
from torchtitan_lite.runtime.replica_launcher import RESTARTED
from torchtitan_lite.runtime.signals import Preemption
from torchtitan_lite.runtime.watchdog import Watchdog
from torchtitan_lite.training import replica_state
from torchtitan_lite.training.replica_quorum import ids_across_lighthouses
from torchtitan_lite.training.replica_config import import_torchft
from torchtitan_lite.training.replica_writer import GroupWriter

logger = logging.getLogger("torchtitan_lite")

def restarts() -> int:
    """How many times this group has been started again: by its torchrun (MAX_RESTARTS), or as a whole by
    run_train.sh's REPLICA_GROUPS mode (runtime/replica_launcher.py)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + int(os.environ.get(RESTARTED, "0"))


class NoReplicas:
    """A run of one group: every step is committed at its first attempt, and this job logs and saves every one."""

    def __init__(self):
        self.writer = Writer()  # this job alone, always
        self.unwritten: list[dict] = []  # the log records not yet in the file (metric_logger.py)

    def join(self, history: Callable[[], None], adopt: Callable[[], None]) -> None:
        history()

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
    committed step is logged once whoever has died meanwhile: that group claims the folder at the first step it
    commits in a new membership, and writes only while its claim holds (runtime/fence.py), so a group that was
    frozen never writes over the one that went on without it. Every group keeps its records until the file holds
    their steps (metric_logger.py), so a new writer logs what the one before it committed and never logged, and
    saves at once if that one left without saving its last interval step (replica_writer.py). The run's history
    (run_history.py) begins at its first committed step, in the group that logs it: a group that heals, or that
    committed a step beside the one that logged it, joins a history begun already and never begins another.
    """

    def __init__(self, cfg: FaultTolerance, group_rank: int, group_size: int, dp_rank: int, dp_size: int,
                 data: DataLoader, states: dict[str, Stateful], train_state: TrainState, params: list,
                 preemption: Preemption, resumable: bool, folder: str, at_start: tuple[int, int] | None,
                 step_timeouts: tuple[float, float]):
        torchft = import_torchft()
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
        # The log records this group made and the file does not hold yet (metric_logger.py keeps them; rank 0's):
        # a group that heals gets them, so that it writes those its server never will, should it become the writer.
        self.unwritten: list[dict] = []
        self._batches = 0.0  # the global batches this group trained since the last log record: its share of each
        if self.fast:
            data.dp_rank, data.dp_size = cfg.replica_id * dp_size + dp_rank, cfg.group_size * dp_size
        self._history: Callable[[], None] | None = None  # begins the run's history, until it has one
        self._adopt: Callable[[], None] | None = None  # takes up a history another group began, as its writer
        # Whether this group writes the folder (replica_writer.py); metrics.jsonl as this job found it at its start.
        self.writer, self._at_start = GroupWriter(cfg.replica_id, group_rank, folder, preemption.group,
                                                  first=lambda: self._rank == 0), at_start
        # A step must reach its all-reduce across the groups within comm.init_timeout_seconds (this job's first) or
        # comm.train_timeout_seconds, or this group leaves the run (watchdog.py).
        self._watchdog, self._step_timeouts = Watchdog(f"replica group {cfg.replica_id}"), step_timeouts
        timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
        pg = torchft.ProcessGroupGloo(timeout=timeout)
        # The state travels over the groups' own process group, from each rank to the same rank of the group behind.
        with flight_recorder.unseen_by_torchft():  # else it makes an empty comm_traces/ folder per quorum
            self.manager = torchft.Manager(
                pg=pg, load_state_dict=self._load, state_dict=self._serve, min_replica_size=cfg.min_replica_size,
                use_async_quorum=False, quorum_timeout=timedelta(milliseconds=cfg.quorum_timeout_ms), rank=group_rank,
                world_size=group_size, replica_id=f"replica_{cfg.replica_id}", lighthouse_addr=cfg.lighthouse or None,
                checkpoint_transport=PGTransport(pg, timeout, torch.device("cpu")),
                init_sync=False,  # every group initializes alike (init.py)
                # A request the lighthouse failed (it died: runtime/lighthouse.py) is asked again every 5 s, by when a
                # new one knows every live group; none, torchft's default, and the group waits out quorum_timeout_ms.
                quorum_retries=max(1, cfg.quorum_timeout_ms // 5000))
        ids_across_lighthouses(self.manager)  # quorum ids a restarted lighthouse cannot confuse (replica_quorum.py)
        self.manager.load_state_dict({"step": train_state.step, "batches_committed": 0})

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    def _quorum(self) -> None:
        """Who is alive for the next attempt, asked within twice quorum_timeout_ms or this group leaves (torchft's
        request waits on for good for a lighthouse that died and never came back)."""
        self._watchdog.arm(2 * self.cfg.quorum_timeout_ms / 1000,
                           "asking the lighthouse who is alive (twice fault_tolerance.quorum_timeout_ms)")
        try:
            self._ask()
        finally:
            self._watchdog.disarm()

    def _ask(self) -> None:
        """_quorum's question; a group behind the others loads their state first (_load). With fewer alive than
        min_replica_size no step could commit: it asks again each second, for quorum_timeout_ms at most."""
        before, t0 = self.train_state.step, time.perf_counter()
        self.manager.start_quorum()
        ft, waits, limit = self.cfg, 0, self.cfg.quorum_timeout_ms / 1000
        deadline = t0 + limit
        while (alive := self.manager.num_participants()) < ft.min_replica_size:
            short = (f"{alive} of {ft.group_size} replica groups alive, fewer than the {ft.min_replica_size} a step "
                     f"needs (fault_tolerance.min_replica_size)")
            late = torch.tensor([float(time.perf_counter() > deadline)])
            dist.all_reduce(late, op=ReduceOp.MAX, group=self.preemption.group)  # the group's ranks stop together
            if late.item():
                raise ConfigError(f"{short} for {limit:g}s (fault_tolerance.quorum_timeout_ms): start the missing "
                                  "groups, or lower min_replica_size")
            if not waits:
                logger.warning("%s: waiting %gs at most for more", short, limit)
            waits += 1
            time.sleep(1)
            t0 = time.perf_counter()  # a heal's time is its own quorum's
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
        if not self.fast:  # this rank's part of the live groups' uneven shares
            self.data.share = group_share(self.data.global_batch, self.data.local_batch, self._rank, live,
                                          self.dp_rank, self.dp_size)

    def join(self, history: Callable[[], None], adopt: Callable[[], None]) -> None:
        """The first quorum, before the loop: a group that restarts comes back at the others' step. `history`
        begins the run's history, `adopt` takes up one begun by another group (rank 0's; no-ops elsewhere). A
        restarted group with no live group to heal from and no checkpoints stops: alone it would train the run again
        from its start (the others finished, or died as well)."""
        self._history, self._adopt = history, adopt
        self._quorum()
        self._quorum_ready = True
        self._alone_check()

    def _alone_check(self) -> None:
        """Before this job's first committed step, at a quorum where it is the only live group and has healed from
        none: a group restarted without checkpoints has nothing to rejoin, and one whose step is behind what another
        group logged since this job started (it went on without this one, then finished or died) would train those
        steps again over its records and checkpoints: both stop. Decided by the folder's metrics.jsonl as this job
        found it at its start, not by clocks (fence.behind); the group's ranks agree on one answer."""
        if self._history is None or self.live != 1:
            return  # committed already, or a live group to heal from (should this heal fail, the next one may not)
        if restarts() > 0 and not self.resumable:
            raise ConfigError(f"replica group {self.cfg.replica_id} restarted and found no live group to heal from "
                              "(the others have finished, or died too): without checkpoints there is nothing to "
                              "rejoin; start the run again")
        late = torch.tensor([float(self.group_rank == 0 and behind(self.folder, self.train_state.step,
                                                                      self._at_start))])
        dist.all_reduce(late, op=ReduceOp.MAX, group=self.preemption.group)
        if late.item():
            raise ConfigError(f"replica group {self.cfg.replica_id} is behind the run: another group logged steps "
                              f"past {self.train_state.step} since this one started, and none is alive to heal from "
                              "(they have finished, or died): nothing to rejoin")

    def attempts(self, step: int) -> Iterator[None]:
        """Yields until every live group has committed `step`, each attempt on the same samples; none when a heal
        has already brought this group past it."""
        position = None
        while self.train_state.step < step:
            if not self._quorum_ready:
                if position is not None:
                    self.data.position = position  # the failed attempt's samples again
                self._quorum()
                self._alone_check()
            self._quorum_ready = False
            if self.train_state.step >= step:  # healed from a group that committed it
                self._quorum_ready = True  # in the quorum of the step after its last: this group's next one
                return
            position = self.data.position
            bound, key = ((self._step_timeouts[0], "comm.init_timeout_seconds") if self._alive is None else
                          (self._step_timeouts[1], "comm.train_timeout_seconds"))
            self._watchdog.arm(bound, f"step {step} up to its all-reduce across the groups ({key})")
            try:
                yield
            finally:
                self._watchdog.disarm()
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
        self._watchdog.disarm()  # its step reached the others (or failed with them): the rest has its own bounds
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
            changes = self._say_who_trained(alive)
            self._batches += (1 / self.cfg.group_size if self.fast else  # its share: the rows it trained
                              self.data.share[1] * self.dp_size / self.data.global_batch)
            if self.fast:
                self._skip([g for g in range(self.cfg.group_size) if g not in alive])
            self.preemption.widen(signalled > 0.5)  # every group stops after the same step
            first = self._rank == 0
            if self._history is not None:
                if first:
                    self._history()  # the run's first committed step, which this group logs
                    self._adopt = None
                self._history = None  # else the group that logs it began it
            elif self._adopt is not None and first:  # long begun: the file names the run
                self._adopt()
                self._adopt = None
            if first:
                # The step is counted after its update.
                self.writer.claim(self.manager._quorum_id, self.train_state.step + 1, alive, changes)
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
        trained = {"replica_groups": len(self._alive or ())}  # how many trained the step
        if not self.fast:
            return trained
        skipped, self.skipped = self.skipped, []
        return {**trained, "skipped_samples": skipped}

    def batches_trained(self) -> float:
        """The global batches this group trained since the last call, at logging steps: its tokens per second."""
        batches, self._batches = self._batches, 0.0
        return batches

    def _say_who_trained(self, alive: list[int]) -> dict[str, list[int]]:
        """Names the groups that left or joined since the last committed step; at this job's first one, those
        absent. Returns them by what they did ("left", "joined", "absent"), for the writer's claim."""
        if self._alive is None:
            changes = {"absent": [i for i in range(self.cfg.group_size) if i not in alive]}
        else:
            changes = {"left": [i for i in self._alive if i not in alive],
                       "joined": [i for i in alive if i not in self._alive]}
        changes = {what: groups for what, groups in changes.items() if groups}
        if changes:
            logger.warning("replica groups: %s; training with %s%s", ", ".join(
                f"group {i} {what}" for what, groups in changes.items() for i in groups),
                ", ".join(str(i) for i in alive), " (fast mode: a missing group's samples are skipped)"
                if self.fast and len(alive) < self.cfg.group_size else "")
        self._alive = alive
        return changes

    def finish(self) -> None:
        """Says, on every rank, the digest of its state: the same rank of every group must say the same."""
        logger.info("replica group %d rank %d ends at step %d, state digest %s", self.cfg.replica_id,
                    self.group_rank, self.train_state.step, replica_state.digest(self.states))

    # ---- Healing

    def _serve(self) -> dict[str, Any]:
        """What a group behind gets: every state a checkpoint holds, each tensor as this rank's local shard."""
        return {**{k: replica_state.local(s.state_dict()) for k, s in self.states.items()}, "skipped": self.skipped,
                "records": self.unwritten}

    def _load(self, received: dict[str, Any]) -> None:
        for k, s in self.states.items():
            s.load_state_dict(replica_state.filled(s.state_dict(), received[k]))
        self.skipped = [list(r) for r in received["skipped"]]  # the next record lists them, whichever group logs it
        mine = {r["step"]: r for r in self.unwritten}
        self.unwritten[:] = sorted({**mine, **{r["step"]: dict(r) for r in received["records"]}}.values(),
                                   key=lambda r: r["step"])


def _why(error: Exception | None) -> str:
    """A failed step's cause in a few words: gloo's first sentence, without its source location."""
    if error is None:
        return "another group voted against it: a collective of the step failed there"
    text = str(getattr(error, "original_exception", error)).splitlines()[0]
    return text.rsplit("] ", 1)[-1].split(". ")[0][:160]


def build_replicas(cfg: JobConfig, group_rank: int, group_size: int, dp_rank: int, dp_size: int, data: DataLoader,
                   states: dict[str, Stateful], train_state: TrainState, params: list, preemption: Preemption,
                   exits: contextlib.ExitStack, at_start: tuple[int, int] | None) -> NoReplicas | Replicas:
    """The run's replica groups, chosen once at start-up; `at_start`: the folder's metrics.jsonl as this job found
    it before it loaded a checkpoint (fence.file_state)."""
    if not cfg.fault_tolerance.enable:
        return NoReplicas()
    replicas = Replicas(cfg.fault_tolerance, group_rank, group_size, dp_rank, dp_size, data, states, train_state,
                        params, preemption, cfg.checkpoint.enable, cfg.job.dump_folder, at_start,
                        (cfg.comm.init_timeout_seconds, cfg.comm.train_timeout_seconds))
    exits.callback(replicas.close)
    return replicas
