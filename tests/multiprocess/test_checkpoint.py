"""Checkpoints end to end: real torchrun jobs on the CPU writing and reading real DCP folders.

Every run has the shared runs' settings (launch.COMMON: global batch 8, a constant lr after warmup) and saves every 2
steps, so a run resumed from the shared FSDP 4 or TP 2 x FSDP 2 run's step-4 continues that very run (conftest.py).
The same layout resumed is bitwise equal to the straight run; a resume on another layout agrees to 1e-5 (the
reductions run in another order), like tests/multiprocess/test_layouts.py.
"""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

import train as train_module

from launch import (CHECKPOINTED, COMMON, ROOT, STEPS, TINY, TP2, TRAIN, assert_one_error_line, assert_same_curve, ckpt,
                    curve, kill_tree, losses, metric, read_metrics, resumes, snapshot, stopped_after, torchrun,
                    torchrun_cmd, torchrun_several, train_in_process, train_job)
from torchtitan_lite.checkpoint.folder import complete_checkpoints
from torchtitan_lite.runtime.run_history import history_run
from torchtitan_lite.config import ConfigError
from torchtitan_lite.checkpoint.reader import read_tensors

pytestmark = pytest.mark.reads("resumed_4p")  # the resumed runs and resharding legs

BPE = str(ROOT / "torchtitan_lite" / "assets" / "stdlib_bpe_2k.tiktoken")
SLOW_DELETE = ROOT / "tests" / "multiprocess" / "slow_delete.py"
TOLERANCE = 1e-5


def train(nproc, folder, *overrides, steps=STEPS, **kw):
    """A checkpointing run with the shared runs' settings (with 1 process, in this process: see launch.train_job)."""
    return train_job(nproc, folder, *COMMON, *CHECKPOINTED, "--training.steps", str(steps), *overrides, **kw)


def assert_continues(resumed, reference, first_step):
    assert sorted(s for s in losses(resumed) if s >= first_step) == list(range(first_step, 9))
    assert_same_curve(resumed, reference, TOLERANCE, steps=range(first_step, 9))


def assert_same_state(resharded, reference):
    """Every tensor of two checkpoints agrees to 1e-4 of its tensor's largest value: the optimizer moments too,
    which a load that dropped or misplaced them would change at the scale of the gradients."""
    got, ref = read_tensors(str(resharded)), read_tensors(str(reference))
    assert got.keys() == ref.keys() and any(k.endswith(".exp_avg_sq") for k in ref)
    for key, value in ref.items():
        scale = value.abs().max().item() if value.is_floating_point() else 0
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-4 * scale, msg=key)


# ---- Resumed runs, shared by the tests below.

@pytest.fixture(scope="module")
def fsdp_straight(runs):
    """FSDP 4, 8 steps straight, a synchronous save every 2 steps."""
    return runs["fsdp4"]


@pytest.fixture(scope="module")
def fsdp_split(runs):
    """FSDP 4 stopped after step 4, resumed to 8 with async saves, a half-written-looking step-99 in the way
    (run_table.RESUMED_RUNS): its folder and what its job printed."""
    return runs["fsdp4_resumed"], runs.output("fsdp4_resumed")


@pytest.fixture(scope="module")
def tp_straight(runs):
    return runs["tp2_fsdp2"]


@pytest.fixture(scope="module")
def tp_split(runs):
    """TP 2 x FSDP 2 stopped after step 4, resumed to 8 keeping the latest 2 checkpoints (conftest.py)."""
    return runs["tp2_fsdp2_resumed"]


# ---- Resume

def test_resume_is_bitwise_on_fsdp(fsdp_straight, fsdp_split):
    folder, _ = fsdp_split
    assert curve(folder) == curve(fsdp_straight)
    assert [m["step"] for m in read_metrics(folder)] == list(range(1, 9))  # appended, steps continue
    assert [(r["step"], r["world_size"], r["run"]) for r in resumes(folder)] == [(4, 4, history_run(folder))]
    assert [m["tokens_seen"] for m in read_metrics(folder)] == [m["tokens_seen"] for m in read_metrics(fsdp_straight)]


def test_resume_is_bitwise_on_tp_fsdp(tp_straight, tp_split):
    assert curve(tp_split) == curve(tp_straight)


def test_folder_without_metadata_is_skipped(fsdp_split):
    folder, output = fsdp_split
    assert f"loaded full state from {ckpt(folder, 4)}" in output
    assert sorted(complete_checkpoints(str(folder / "checkpoint"))) == [2, 4, 6, 8]


def test_keep_latest_k_deletes_older_checkpoints(tp_split):
    assert sorted(os.listdir(tp_split / "checkpoint")) == ["step-6", "step-8"]


def test_async_save_equals_sync_save(fsdp_straight, fsdp_split):
    # step-6 was written in the background while steps 7 and 8 trained: equal tensors mean the state was copied.
    folder, _ = fsdp_split
    for step in (6, 8):
        sync, background = read_tensors(str(ckpt(fsdp_straight, step))), read_tensors(str(ckpt(folder, step)))
        assert sync.keys() == background.keys() and any(k.startswith("optimizer.state.") for k in sync)
        for key in sync:
            assert torch.equal(sync[key], background[key]), key


def test_finished_run_has_nothing_to_do(fsdp_straight, tmp_path):
    shutil.copytree(fsdp_straight, tmp_path / "run")
    proc = train(1, tmp_path / "run")
    assert "nothing to do" in proc.stdout + proc.stderr
    assert len(read_metrics(tmp_path / "run")) == len(read_metrics(fsdp_straight))


def test_extended_run_follows_the_new_schedule_and_optimizer_settings_from_its_first_step(tmp_path):
    # tiny.toml decays over the last half: a finished 4-step run's optimizer holds lr 0, the old schedule's end. The
    # extension also changes the weight decay, which DCP's load would otherwise take from the checkpoint.
    extended, fresh = tmp_path / "extended", tmp_path / "fresh"
    train_in_process(extended, "--checkpoint.enable", "--training.steps", "4")
    proc = train_in_process(extended, "--checkpoint.enable", "--training.steps", "6", "--optimizer.weight_decay", "0")
    train_in_process(fresh, "--training.steps", "6")
    lr, expected = metric(extended, "lr"), metric(fresh, "lr")
    assert [lr[s] for s in (5, 6)] == [expected[s] for s in (5, 6)] and expected[5] > 0
    assert proc.stdout.count("the lr schedule changed since the checkpoint (training.steps 4 -> 6): the lr of step 5 "
                             "follows the new schedule") == 1
    assert proc.stdout.count("the optimizer's settings changed since the checkpoint (optimizer.weight_decay 0.1 -> "
                             "0.0): the resumed steps use the new ones") == 1


# ---- Resharding: the data position is global and DCP reshards every DTensor, so the curve goes on.

# The first legs, to step 6, run in the job of the 4-process resumed runs (run_table.RESHARD_LEGS); the second legs
# here.

def test_reshard_fsdp_to_tp_fsdp_to_single_process(fsdp_straight, resharded):
    folder = resharded["tp2_fsdp2"]
    assert_same_state(ckpt(folder, 6), ckpt(fsdp_straight, 6))
    train(1, folder)
    assert_continues(folder, fsdp_straight, first_step=5)
    assert_same_state(ckpt(folder, 8), ckpt(fsdp_straight, 8))


def test_reshard_fsdp_to_hsdp_via_initial_load_to_single_process(fsdp_straight, resharded):
    # FSDP 4 -> HSDP 2 x 2 -> 1 process. The first run's own folder was empty, so it started from initial_load_path
    # (full state) and never wrote there; the second finds its own step-6 and resumes that instead.
    source, tmp_path = ckpt(fsdp_straight, 4), resharded["hsdp2x2"]
    initial = ("--checkpoint.initial_load_path", str(source), "--no-checkpoint.initial_load_model_only")
    assert not ckpt(tmp_path, 4).exists() and sorted(complete_checkpoints(str(tmp_path / "checkpoint"))) == [6]
    assert_same_state(ckpt(tmp_path, 6), ckpt(fsdp_straight, 6))
    proc = train(1, tmp_path, *initial)
    assert f"loaded full state from {ckpt(tmp_path, 6)}" in proc.stdout + proc.stderr
    assert_continues(tmp_path, fsdp_straight, first_step=5)
    assert_same_state(ckpt(tmp_path, 8), ckpt(fsdp_straight, 8))
    assert snapshot(source) == resharded["source_snapshot"]


# ---- Seed checkpoint and export

def test_seed_checkpoint_gives_every_mesh_the_same_start(tmp_path):
    # The seed is made with another training.seed than the runs, so equal weights prove the runs loaded it. An lr of
    # 1e-30 leaves every fp32 weight unchanged by the first step, so the step-1 export shows the starting weights.
    train_in_process(tmp_path / "seed", "--checkpoint.create_seed_checkpoint", "--training.seed", "123")
    seed = read_tensors(str(ckpt(tmp_path / "seed", 0)))
    assert seed and all(k.startswith("model.") for k in seed)
    meshes = {"fsdp": ((), "float32"), "tp": (TP2, "bfloat16")}
    for name in meshes:
        shutil.copytree(ckpt(tmp_path / "seed", 0), ckpt(tmp_path / name, 0))
    # Both meshes' runs in one 2-process job (several_runs.py): each loads the seed from its own folder.
    torchrun_several(2, [(tmp_path / name, False, (*COMMON, *CHECKPOINTED, "--training.steps", "1", *mesh,
                                                   "--optimizer.lr", "1e-30", "--checkpoint.last_save_model_only",
                                                   "--checkpoint.export_dtype", dtype))
                         for name, (mesh, dtype) in meshes.items()])
    for name, (_, dtype) in meshes.items():
        exported = read_tensors(str(ckpt(tmp_path / name, 1)))
        assert exported.keys() == seed.keys()
        for key, value in seed.items():
            assert exported[key].dtype == getattr(torch, dtype)
            assert torch.equal(exported[key], value.to(exported[key].dtype)), key


def test_async_seed_checkpoint_is_published(tmp_path):
    # As the 8B/70B/405B configs set it: checkpoints enabled, saved asynchronously.
    train_in_process(tmp_path, "--checkpoint.enable", "--checkpoint.async_mode", "async",
                     "--checkpoint.create_seed_checkpoint")
    assert os.listdir(tmp_path / "checkpoint") == ["step-0"] and complete_checkpoints(str(tmp_path / "checkpoint"))


def test_seed_checkpoint_on_several_processes_is_refused(tmp_path):
    proc = torchrun(2, tmp_path, "--checkpoint.create_seed_checkpoint", check=False)
    assert_one_error_line(proc, "NGPU=1")
    assert not (tmp_path / "checkpoint").exists()


# ---- Failures: a killed save, a checkpoint of another shape, missing paths

@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds torchrun's workers through /proc")
def test_kill_during_save_leaves_the_previous_checkpoint(fsdp_straight, tmp_path):
    stopped_after(fsdp_straight, 4, tmp_path)
    before = snapshot(ckpt(tmp_path, 4))
    # Resume from step-2 and save step-4 again; the coordinator pauses with all shards written and no .metadata.
    log = tmp_path / "killed.log"
    cmd, env = torchrun_cmd(2, TRAIN, "--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path),
                            *COMMON, *CHECKPOINTED, "--training.steps", "4", "--checkpoint.load_step", "2")
    env["TORCHTITAN_LITE_TEST_PAUSE_BEFORE_METADATA_S"] = "300"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:  # polls the log, bounded only as a hang detector
            deadline = time.monotonic() + 300
            while "pausing" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "pausing" in log.read_text(), log.read_text()[-3000:]
        finally:  # like a node failure: every process of the job at once
            kill_tree(proc)
    tmp = ckpt(tmp_path, 4).with_name("step-4.tmp")
    assert tmp.is_dir() and not (tmp / ".metadata").exists()
    assert snapshot(ckpt(tmp_path, 4)) == before
    proc = train(1, tmp_path, steps=6)  # picks step-4, and its first save clears the leftover
    assert f"loaded full state from {ckpt(tmp_path, 4)}" in proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2", "step-4", "step-6"]


def test_a_re_save_killed_between_its_renames_is_published_and_resumed(fsdp_straight, tmp_path):
    """A re-save of step-4 killed between its two renames (tests/test_checkpoint_trash.py kills one for real): the old
    copy moved to the trash, the new one complete as step-4.tmp. The next run publishes it at load and resumes from
    it; one with another training.seed is refused first, in one line, as its data order would differ."""
    stopped_after(fsdp_straight, 4, tmp_path)
    folder = tmp_path / "checkpoint"
    os.rename(ckpt(tmp_path, 4), folder / "step-4.tmp")
    shutil.copytree(ckpt(tmp_path, 2), folder / "step-4.0a1b2c3d.trash")  # what was step-4 before the re-save
    proc = train(1, tmp_path, "--training.seed", "8", steps=6, check=False)
    assert_one_error_line(proc, "the checkpoint was trained with training.seed 7 and this run has 8: the seed keys "
                                "the data order")
    assert (folder / "step-4" / ".metadata").is_file() and not (folder / "step-4.tmp").exists()
    proc = train(1, tmp_path, steps=6)
    assert f"loaded full state from {ckpt(tmp_path, 4)}" in proc.stdout + proc.stderr
    assert_same_curve(tmp_path, fsdp_straight, TOLERANCE, steps=range(5, 7))
    assert sorted(os.listdir(folder)) == ["step-2", "step-4", "step-6"]


def test_checkpoint_of_another_vocab_names_the_tensor(fsdp_straight, tmp_path):
    shutil.copytree(ckpt(fsdp_straight, 8), ckpt(tmp_path, 8))
    before = snapshot(tmp_path / "checkpoint")
    proc = train(2, tmp_path, "--model.tokenizer_path", BPE, steps=10, check=False)
    assert_one_error_line(proc, "model.tok_embeddings.weight has shape (258, 256) in the checkpoint but (2050, 256) "
                                "here")
    assert "exitcode  : 2" in proc.stderr and "DTensor" not in proc.stderr
    assert snapshot(tmp_path / "checkpoint") == before


@pytest.mark.parametrize("override, message", [
    (("--checkpoint.load_step", "3"), "checkpoint.load_step 3: {folder}/checkpoint/step-3 is not a complete"),
    (("--checkpoint.initial_load_path", "{folder}/elsewhere/step-5"),
     "checkpoint.initial_load_path {folder}/elsewhere/step-5 does not exist"),
])
def test_missing_checkpoint_is_a_config_error(tmp_path, override, message):
    override = [o.format(folder=tmp_path) for o in override]
    proc = train(1, tmp_path, *override, check=False)
    assert_one_error_line(proc, message.format(folder=tmp_path))


@pytest.mark.parametrize("error", ["nan", "config"])
def test_a_run_stopped_by_an_error_publishes_its_healthy_async_save(tmp_path, monkeypatch, error):
    # Step 2's save is still in flight when step 3 stops the run: at step 3's log, on a NaN loss; or as it reads its
    # batch, on a config error (a streamed dataset found changed since it was saved raises one then).
    batches, next_batch = [], train_module.DataLoader.next_batch

    def counted_batch(self):
        batches.append(1)
        if error == "config" and len(batches) == 3:
            raise ConfigError("the dataset changed since it was saved")
        return next_batch(self)

    monkeypatch.setattr(train_module.DataLoader, "next_batch", counted_batch)
    cross_entropy = torch.nn.functional.cross_entropy
    monkeypatch.setattr(torch.nn.functional, "cross_entropy",
                        lambda *a, **k: cross_entropy(*a, **k) * (float("nan") if len(batches) == 3 else 1))
    proc = train(1, tmp_path, "--checkpoint.async_mode", "async", steps=6, check=False)
    if error == "nan":
        assert proc.returncode == 1 and "step 3: the gradient norm is nan" in proc.stderr
    else:
        assert_one_error_line(proc, "the dataset changed since it was saved")
    assert os.listdir(tmp_path / "checkpoint") == ["step-2"]
    assert list(complete_checkpoints(str(tmp_path / "checkpoint"))) == [2]


def test_deleting_old_checkpoints_slower_than_the_training_timeout_stops_nothing(tmp_path):
    # Each delete takes 6 s, twice comm.train_timeout_seconds: rank 0 must not make the other rank wait for it.
    proc = torchrun(2, tmp_path, *COMMON, *CHECKPOINTED, "--training.steps", "4", "--checkpoint.keep_latest_k", "1",
                    "--comm.train_timeout_seconds", "3", script=SLOW_DELETE, script_args=("6",))
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert "waiting for the deletion of 1 checkpoint folder(s)" in proc.stdout + proc.stderr
    assert os.listdir(tmp_path / "checkpoint") == ["step-4"]  # the run waited for the delete before it exited
