"""Which replica group writes the run's folder, and whether it still may: checkpoint.manager.Writer for a group.

The first of the live groups (its quorum rank 0) logs each step and saves the checkpoints (training/replicas.py). It
claims the folder at the first step it commits in a membership of its own (runtime/fence.py), and writes only while
that claim is the newest: a group frozen after a commit finds, when it wakes, that another has taken over, and stands
down. At a claim it also learns the previous writer's tag, whose saves in progress are left over and whose last
interval step may have gone unsaved (the checkpoint manager then saves at once: CheckpointManager._catch_up).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchtitan_lite.checkpoint.manager import Writer
from torchtitan_lite.runtime.fence import Fence


class GroupWriter(Writer):
    """Replica group `replica_id`'s part: `first` says whether it is the first of the live groups now; rank 0 of the
    group (`group_rank`) reads and writes the claim, and the group's ranks agree over `host_group` before a save."""

    def __init__(self, replica_id: int, group_rank: int, folder: str, host_group: dist.ProcessGroup | None,
                 first: Callable[[], bool]):
        self.replica_id, self.group_rank, self.host_group, self.first = replica_id, group_rank, host_group, first
        self.fence = Fence(folder)
        self._quorum = None  # the quorum id of this group's latest claim
        self._took_over: tuple[int, str] | None = None  # (the step of its latest claim, the previous writer's tag)
        self._tags: set[str] = set()  # of this job's claims: its own saves are never left over

    def holds(self) -> bool:
        """Whether this group writes now: the first of the live groups, while its claim holds (rank 0 reads it; the
        metric logger asks on rank 0 alone, before each record)."""
        if not self.first():
            return False
        if self.group_rank != 0 or self.fence.holds():
            return True
        self.fence.stand_down(self.replica_id)
        return False

    def may_write(self) -> bool:
        """holds() as the group's ranks agree on it, before they save together."""
        if not self.first():
            return False
        holds = torch.tensor([float(self.holds())])
        dist.all_reduce(holds, op=ReduceOp.MIN, group=self.host_group)
        return bool(holds.item())

    def tag(self) -> str:
        return f"g{self.replica_id}q{self._quorum}"

    def took_over(self, step: int) -> str | None:
        return self._took_over[1] if self._took_over is not None and self._took_over[0] == step else None

    def claim(self, quorum: int, step: int, alive: list[int], changes: dict[str, list[int]]) -> None:
        """At a step this group commits as the first of the live groups: claims the folder if the membership (the
        `quorum` id) is new since its last claim. The claim's record in metrics.jsonl names the groups that trained
        the step, those that left or joined, and this group as the run's writer from here on."""
        if quorum == self._quorum:
            return
        self._quorum, previous = quorum, ""
        if self.group_rank == 0:
            event = {"writer": self.replica_id, "trained": alive, **changes}
            previous = self.fence.claim(step, self.tag(), event) or ""
        self._tags.add(self.tag())
        self._took_over = (step, "" if previous in self._tags else previous)
