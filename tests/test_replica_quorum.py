"""torchtitan_lite/training/replica_quorum.py: the quorum ids torchft's Manager is shown, against the lighthouse's,
before and after the lighthouse is started again (its ids from 1 again)."""

from types import SimpleNamespace

from torchtitan_lite.training.replica_quorum import ids_across_lighthouses


def quorum(lighthouse_id: int, members: list[str], step: int, heal: bool = False) -> SimpleNamespace:
    return SimpleNamespace(quorum_id=lighthouse_id, replica_ids=members, max_step=step, heal=heal, store_address="s")


def shown(*quorums: SimpleNamespace) -> list[int]:
    """The ids a Manager is shown for `quorums`, in turn (its client answers them)."""
    answers = iter(quorums)
    manager = SimpleNamespace(_client=SimpleNamespace(_quorum=lambda **kw: next(answers), should_commit=lambda: True))
    ids_across_lighthouses(manager)
    got = [manager._client._quorum(group_rank=0) for _ in quorums]
    assert manager._client.should_commit() and all(a.store_address == "s" for a in got)  # the rest as it was
    return [a.quorum_id for a in got]


def test_under_one_lighthouse_an_id_is_new_when_the_lighthouses_is_and_grows_with_the_step():
    ids = shown(quorum(1, ["a", "b"], 4), quorum(1, ["a", "b"], 5), quorum(2, ["a"], 6), quorum(3, ["a", "b"], 7))
    assert ids[0] == ids[1] and len(set(ids)) == 3 and ids == sorted(ids)


def test_a_restarted_lighthouses_reused_id_is_new_where_the_groups_process_groups_differ():
    # Group 0 was stopped in quorum 1 of the old lighthouse; the new one gives 1 again, group 0 behind: both rebuild,
    # group 1 (which went on in quorum 2, alone) under the same id.
    stopped = shown(quorum(1, ["g0", "g1"], 4), quorum(1, ["g0", "g1"], 5, heal=True))
    went_on = shown(quorum(1, ["g0", "g1"], 4), quorum(2, ["g1"], 4), quorum(1, ["g0", "g1"], 5))
    assert stopped[1] != stopped[0] and went_on[2] == stopped[1]
    # The new lighthouse's first quorum is one group's alone, with that group's last id.
    assert len(set(shown(quorum(1, ["a", "b"], 4), quorum(1, ["a"], 4)))) == 2
    # Nothing happened between the two lighthouses: the groups keep their process group.
    assert len(set(shown(quorum(1, ["a", "b"], 4), quorum(1, ["a", "b"], 5)))) == 1
