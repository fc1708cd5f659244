"""No host-device sync between logging steps: a GPU runs ahead of the host through every step that only trains.

A real 4-process TP 2 x FSDP 2 run (in probes.py's job; tools/sync_count.py records each sync with the line of ours that asked for it), with
the non-finite guard counting (training.skip_nonfinite_steps), logging every 3rd step. The only sync of a step that
only trains is the preemption agreement's (signals.py), whose flag is a host tensor on a GPU machine (a gloo group on
the CPU), so it never waits for the device.
"""

import json

import pytest

import probes
from launch import COMMON, TINY, TP2
from torchtitan_lite.models.llama3.model import FLAVORS
from torchtitan_lite.tools.sync_count import HOST_READS

pytestmark = pytest.mark.reads("probes")

LOGGED = {1, 3, 6}
HOST, HOST_AT_LOGGING = HOST_READS  # the preemption flag every step; the stragglers' step times at logging steps
# A logging step reads the loss (with a mixture's per-source sums: one .tolist()) and grad norm it logs, the guard's stop latch and skip count (check), and the skip
# count it records (metrics): 5 device syncs, once per log_freq steps.
LOGGING_STEP_SYNCS = sorted(f"{site}@cpu" for site in ["train.py:main", "train.py:main", "precision.py:check",
                                                       "precision.py:check", "precision.py:metrics"])


probes.register("syncs", "--job.config_file", str(TINY), *COMMON, *TP2, "--training.local_batch_size", "4",
                "--training.steps", "6", "--metrics.log_freq", "3", "--training.skip_nonfinite_steps", "1")


@pytest.fixture(scope="module")
def syncs(probed):
    return [json.loads((probed / "syncs" / f"syncs-{rank}.json").read_text()) for rank in range(4)]


def test_steps_that_only_train_never_wait_for_the_device(syncs):
    for rank in syncs:
        assert sorted(map(int, rank)) == [1, 2, 3, 4, 5, 6]
        for step in {2, 4, 5}:
            assert rank[str(step)] == [HOST], f"step {step}"


def test_a_logging_step_syncs_five_times(syncs):
    for rank in syncs:
        for step in LOGGED - {6}:  # step 6, the last, also checks the guard once more after the loop
            device = sorted(site for site in rank[str(step)] if site not in (HOST, HOST_AT_LOGGING))
            assert device == LOGGING_STEP_SYNCS, f"step {step}"
            assert HOST_AT_LOGGING in rank[str(step)]  # .tolist() is seen: the loss's own read is one


# Expert parallelism (tiny_moe, EP 2 x FSDP 2): all_to_all_single takes its split sizes as integers, so each MoE
# layer's dispatch reads them on the host, once per micro-batch (torchtitan's dispatcher does the same).
probes.register("syncs_ep", "--job.config_file", str(TINY), *COMMON, "--model.flavor", "tiny_moe",
                "--parallelism.expert_parallel_degree", "2", "--training.steps", "3", "--metrics.log_freq", "3",
                "--moe.router_z_loss", "1e-3")  # beside tiny_moe's auxiliary loss: both summed on the device


def test_expert_parallelism_reads_its_split_sizes_once_a_layer_a_micro_batch(probed):
    layers = FLAVORS["tiny_moe"].n_layers  # every block MoE; 1 micro-batch a rank (8 sequences, 4 ranks of 2)
    for rank in range(4):
        step2 = json.loads((probed / "syncs_ep" / f"syncs-{rank}.json").read_text())["2"]
        assert sorted(step2) == sorted([HOST] + ["expert_parallel.py:split_sizes@cpu"] * layers), step2


# Muon on the same layout (TP 2 x FSDP 2, every matrix gathered whole and orthogonalized), in float16 with its loss
# scaling, training the z-loss (its log-sum-exp over the vocabulary-sharded logits: loss parallel): Muon's collectives,
# the iteration and a skipped step's masking, the scaler's decision and the z-loss's sums all stay on the device
# (training/muon.py, runtime/precision.py, training/z_loss.py), so a step that only trains reads nothing of them.
probes.register("syncs_muon", "--job.config_file", str(TINY), *COMMON, *TP2, "--training.local_batch_size", "4",
                "--training.steps", "3", "--metrics.log_freq", "3", "--training.mixed_precision_param", "float16",
                "--optimizer.name", "Muon", "--training.z_loss", "1e-4")


def test_muon_and_z_loss_steps_that_only_train_never_wait_for_the_device(probed):
    for rank in range(4):
        steps = json.loads((probed / "syncs_muon" / f"syncs-{rank}.json").read_text())
        assert sorted(map(int, steps)) == [1, 2, 3]
        assert steps["2"] == [HOST], steps["2"]
