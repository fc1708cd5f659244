"""Quorum ids that name one membership of the replica groups, across a restarted lighthouse.

torchft's Manager rebuilds its process group across the groups when the lighthouse's quorum id differs from the
last one it built for, and the ranks meet to rebuild it in one group's TCP store, under a prefix named by that id,
where each leaves its address. Within one lighthouse's life an id is one membership for as long as it lasts: a new
id whenever a group joins, leaves or fails a step. A lighthouse started again (runtime/lighthouse.py) numbers from 1
again, and both uses of the id fail (found by killing one, tests/multiprocess/test_replica_groups.py): a group whose
last id the new lighthouse happens to give again keeps a process group its peers have since rebuilt (a heal over
it failed, and the group sending it hung in its next all-reduce until its watchdog ended it 100 s later), and a
prefix used before holds the addresses of a dead process group.

So the Manager is shown an id of this module's instead (its client answered through `_Quorums`). It is new exactly
when the lighthouse's id changes, as before, and also when the quorum's members are not those of the last rebuild
or this group is behind them (it heals): under one lighthouse neither happens without a new id, since the members
of one id commit the same steps; after a restart, either says that the groups' process groups differ. The id is a
function of what every group of the quorum knows alike (the lighthouse's id, the step they are at, who they are:
each group's id carries a number its process drew at start-up), so all of them rebuild under one prefix, one that no
earlier quorum used unless the old lighthouse gave the same number to the same processes at the same step (it moved
on within a step, by a failed attempt, and died before the step was committed). It grows with the step, as the
writer's fence token (replicas.py) reads best: step * 10^6 + a hash.
"""

from __future__ import annotations

import hashlib
from typing import Any


class _Quorums:
    """The Manager's client, answering quorums with this module's ids."""

    def __init__(self, client: Any):
        self._client = client
        self._built: tuple[int, list[str]] | None = None  # (lighthouse id, members) of the last rebuild
        self._id = -1  # the id the Manager was last shown

    def _quorum(self, *args, **kwargs):
        q = self._client._quorum(*args, **kwargs)
        if self._built != (q.quorum_id, q.replica_ids) or q.heal:
            self._built = (q.quorum_id, q.replica_ids)
            name = f"{q.quorum_id}|{','.join(q.replica_ids)}".encode()
            self._id = q.max_step * 10**6 + int(hashlib.sha1(name).hexdigest(), 16) % 10**6
        return _Answer(q, self._id)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


class _Answer:
    """A quorum as the lighthouse answered it, but for its id."""

    def __init__(self, quorum: Any, quorum_id: int):
        self._quorum, self.quorum_id = quorum, quorum_id

    def __getattr__(self, name: str):
        return getattr(self._quorum, name)


def ids_across_lighthouses(manager: Any) -> None:
    """From now on `manager` sees this module's quorum ids (torchft 0.2.0's Manager: its client, `_client`)."""
    manager._client = _Quorums(manager._client)
