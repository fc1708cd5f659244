"""torchtitan_lite/training/replicas.py without processes: what a run of replica groups refuses, in one line each,
the global batch it trains, the plan it says, and the folder's lock its groups share (runtime/run_lock.py)."""

import os

import pytest

from tests.multiprocess.launch import TINY
from tests.test_plan import plan_of
from torchtitan_lite.config import ConfigError, load_config
from torchtitan_lite.data.loader import group_share
from torchtitan_lite.runtime import run_lock
from torchtitan_lite.training.preflight import preflight
from torchtitan_lite.runtime.fence import behind, file_state

LIGHTHOUSE = ("--fault_tolerance.lighthouse", "http://localhost:29510")


def groups(*argv: str) -> list[str]:
    return ["--job.config_file", str(TINY), "--fault_tolerance.enable", *LIGHTHOUSE, *argv]


def global_batch(argv: list[str], world_size: int = 1) -> int:
    return preflight(load_config(argv), world_size)[3]


@pytest.mark.parametrize("argv, world_size, expected", [
    (groups("--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "2"), 1,
     "fault_tolerance.replica_id 2 must be below fault_tolerance.group_size 2: number the groups 0 to 1"),
    (groups("--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", "3"), 1,
     "fault_tolerance.min_replica_size 3 is more than the 2 groups"),
    (groups("--fault_tolerance.group_size", "3", "--training.global_batch_size", "4"), 1,
     "training.global_batch_size 4 gives fewer than one micro-batch to each of 3 groups of local_batch_size 2 x "
     "data-parallel degree 1: use at least 6"),
    (groups("--parallelism.data_parallel_replicate_degree", "2"), 2,
     "turn off parallelism.data_parallel_replicate_degree"),
    (groups("--checkpoint.create_seed_checkpoint", "--metrics.enable_tensorboard"), 1,
     "turn off checkpoint.create_seed_checkpoint, metrics.enable_tensorboard"),
    (groups("--model.flavor", "tiny_moe"), 1, "turn off a mixture-of-experts flavor"),
])
def test_what_replica_groups_cannot_do_is_refused_in_one_line(argv, world_size, expected):
    with pytest.raises(ConfigError) as e:
        preflight(load_config(argv), world_size)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_without_a_lighthouse_the_line_says_where_to_name_it(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match="set fault_tolerance.lighthouse http://HOST:PORT or TORCHFT_LIGHTHOUSE"):
        preflight(load_config(["--job.config_file", str(TINY), "--fault_tolerance.enable"]), 1)


def test_the_global_batch_is_every_groups_and_the_plan_says_each_ones_share():
    """-1: a micro-batch on every rank of each group; any batch of whole micro-batches, one at least for each group,
    is kept, which the live groups share unevenly (8 sequences over 3 groups of 1 rank: 2, 1 and 1 micro-batches)."""
    assert global_batch(groups("--fault_tolerance.group_size", "3"), 2) == 2 * 2 * 3
    assert global_batch(groups("--fault_tolerance.group_size", "2"), 2) == 2 * 2 * 2
    assert global_batch(groups("--fault_tolerance.group_size", "3", "--fault_tolerance.min_replica_size", "2",
                               "--training.global_batch_size", "8")) == 8
    assert global_batch(["--job.config_file", str(TINY)], 2) == 4  # without groups, as before
    data = plan_of(groups("--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "1",
                          "--training.global_batch_size", "8"), world_size=2, peak=None).lines[1]
    assert data.endswith("(2 sequences a rank per micro-batch, 1 micro-batch each, with all 2 replica groups "
                         "alive)"), data
    data = plan_of(groups("--fault_tolerance.group_size", "3", "--training.global_batch_size", "8"), world_size=1,
                   peak=None).lines[1]
    assert data.endswith("(2 sequences a rank per micro-batch, 1 or 2 micro-batches each, with all 3 replica groups "
                         "alive)"), data


def test_uneven_shares_give_every_window_of_the_batch_to_one_rank_of_one_live_group():
    """Exact mode's split (loader.group_share) for any count of live groups: rows of a micro-batch on every rank of a
    group, as many for each group but one more for the first ones, in the data's order, so every window of the global
    batch goes to one rank once; rows that split evenly give each rank the slice a plain run of groups x dp ranks
    reads, as before uneven shares."""
    assert [group_share(8, 2, g, 3, 0, 1) for g in range(3)] == [(0, 4), (4, 2), (6, 2)]
    for batch, local, dp in ((8, 2, 1), (14, 1, 2), (96, 2, 4)):
        for live in range(1, batch // (local * dp) + 1):
            slices = [group_share(batch, local, g, live, r, dp) for g in range(live) for r in range(dp)]
            assert [w for first, n in slices for w in range(first, first + n)] == list(range(batch))
            rows = [n // local for _, n in slices]
            assert all(n % local == 0 for _, n in slices) and min(rows) >= 1 and max(rows) - min(rows) <= 1
            if batch % (local * dp * live) == 0:
                per_rank = batch // (live * dp)
                assert slices == [(i * per_rank, per_rank) for i in range(live * dp)]


def test_in_fast_mode_the_global_batch_splits_over_every_group_alone_and_the_plan_says_so():
    """Fast mode: each group's share is fixed, so the batch must split evenly over all groups at once (exact mode's
    uneven shares take 8 for 3 groups of 1 rank)."""
    fast = ("--fault_tolerance.group_size", "3", "--fault_tolerance.mode", "fast")
    assert global_batch(groups(*fast), 2) == 2 * 2 * 3
    assert global_batch(groups(*fast, "--training.global_batch_size", "6")) == 6
    with pytest.raises(ConfigError, match="does not split into whole micro-batches over 3 groups of local_batch_size "
                                          "2 x data-parallel degree 1: use a multiple of 6"):
        global_batch(groups(*fast, "--training.global_batch_size", "4"))
    assert global_batch(groups("--fault_tolerance.group_size", "3", "--training.global_batch_size", "8")) == 8  # exact
    data = plan_of(groups(*fast, "--training.global_batch_size", "12"), world_size=2, peak=None).lines[1]
    assert data.endswith("1 micro-batch each in each of the 3 replica groups; a missing group's are skipped: "
                         "fault_tolerance.mode fast)"), data


def test_replica_groups_share_the_folders_lock_and_keep_other_runs_out(tmp_path):
    folder = str(tmp_path)
    with run_lock.hold(folder, shared=True), run_lock.hold(folder, shared=True):  # two groups of one run
        run_lock.check_free(folder, shared=True)  # a third group's check
        with pytest.raises(ConfigError, match="is in use by a live run"):
            run_lock.check_free(folder)  # a run of its own
    with run_lock.hold(folder):
        with pytest.raises(ConfigError, match="is in use by a live run"):
            run_lock.check_free(folder, shared=True)  # and groups wait for a plain run to end


def test_a_group_is_behind_the_run_when_another_logged_past_its_step_since_it_started(tmp_path):
    """A group that joins no live group and finds records past its step written since it started would train them
    again over the others' (they finished first); records from before its start are a stopped run's, which its
    resume drops. "Since" is the file's inode and size as the job found them, not its clock."""
    folder, metrics = str(tmp_path), tmp_path / "metrics.jsonl"
    assert not behind(folder, 6, file_state(folder))  # no history yet
    metrics.write_text('{"step": 7, "loss": 1.0}\n{"step": 8, "loss": 0.9}\n')
    assert behind(folder, 6, None)  # written since a start that found no file
    found = file_state(folder)
    assert not behind(folder, 6, found)  # written before: a stopped run's
    with open(metrics, "a") as f:
        f.write('{"event": "groups", "step": 8, "writer": 0, "token": "g0q3"}\n')
    assert behind(folder, 6, found)  # another group claimed the folder since
    assert not behind(folder, 8, found)  # at the run's step: it joins it
    replaced = tmp_path / "new"
    replaced.write_text('{"step": 7, "loss": 1.0}\n{"step": 8, "loss": 0.9}\n')
    os.replace(replaced, metrics)
    assert behind(folder, 6, file_state(folder)) is False and behind(folder, 6, found)  # same size, new file
