"""torchtitan_lite/training/plan.py: the lines a run says before it starts: what it is (block_causal, float8, a
mixture named when on), where it writes and what it does with the folder's checkpoints, and that its steps will
obviously not finish soon on this machine. And a user's TOML that leaves keys out gets the defaults --help shows."""

import re

import torch

from tests.multiprocess.launch import ROOT, TINY, train_in_process
from torchtitan_lite.config import OPTIONS, help_text, load_config
from torchtitan_lite.config.job_config import _default
from torchtitan_lite.training.plan import ending, make_plan
from torchtitan_lite.training.preflight import preflight

# What the user of issue 41 wrote: their data, nothing else.
USERS_OWN = '[training]\ndataset = "jsonl"\ndataset_path = "{path}"\n'
BF16_PEAK = (19.9e9, "bf16 matmul peak of this CPU, 1 thread: 19.9 GFLOP/s, measured once (...), cached in X")


def plan_of(argv, world_size=4, peak=BF16_PEAK):
    cfg = load_config(argv)
    dims, model_args, _, global_batch, _, _ = preflight(cfg, world_size)
    return make_plan(cfg, dims, model_args, global_batch, (lambda dtype: peak) if peak else None)


def users_toml(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"text": "the user\'s own words"}\n' * 500)
    (tmp_path / "my.toml").write_text(USERS_OWN.format(path=tmp_path / "data.jsonl"))
    return ["--job.config_file", str(tmp_path / "my.toml"), "--job.dump_folder", str(tmp_path / "out")]


def test_a_users_toml_gets_the_defaults_help_shows(tmp_path):
    cfg = load_config(users_toml(tmp_path))
    shown = {m.group(1): m.group(2) for m in re.finditer(r"^  --(\S+) \S+ = (.*?)(?:  \{|  must|$)", help_text(), re.M)}
    for key, o in OPTIONS.items():
        if key not in ("training.dataset", "training.dataset_path", "job.config_file", "job.dump_folder"):
            assert _default(o) == shown[key] and getattr(getattr(cfg, o.section), o.name) == o.default, key


def test_a_gpu_sized_step_on_a_cpu_says_so_before_it_starts(tmp_path):
    """The issue's run: 10,000 steps of 32 x 2048 tokens in bf16 on 4 CPU processes. At this CPU's bf16 peak each
    step needs at least 57 s (it ran 11 minutes without finishing one): one warning with the fix."""
    plan = plan_of(users_toml(tmp_path))
    assert plan.warnings == [
        "each step needs 1.1 TFLOP per process, at least 57 s at the bf16 matmul peak of this CPU, 1 thread: 19.9 "
        "GFLOP/s and several times that in practice: the first step will not finish soon (10,000 steps: at least 7 "
        "days); on a CPU, start from train_configs/debug_model.toml, or lower training.local_batch_size and seq_len "
        "and use training.mixed_precision_param float32"]
    assert plan_of(users_toml(tmp_path), peak=None).warnings == []  # a GPU: no CPU bound to give
    debug = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--job.dump_folder",
             str(tmp_path / "d")]
    assert plan_of(debug, peak=(20e9, "fp32 ...")).warnings == []  # 0.2 TFLOP/s would be needed: it is not said


def test_the_plan_names_what_is_on(tmp_path):
    masked = plan_of(["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path), "--model.attn_mask_type",
                      "block_causal", "--training.dataset", "python_stdlib", "--float8.enable_float8_linear",
                      "--float8.emulate", "--compile.enable", "--activation_checkpoint.mode", "full",
                      "--parallelism.tensor_parallel_degree", "2"], peak=None)
    assert masked.lines[0].endswith(
        "mesh dp_shard 2 x tp 2 on 4 processes, block_causal attention (documents masked at each BOS), float32, "
        "float8 tensorwise matmuls (emulated), compiled (inductor), full activation checkpointing")
    mixture = plan_of(["--job.config_file", str(ROOT / "train_configs" / "debug_mixture.toml"), "--job.dump_folder",
                       str(tmp_path)], peak=None)
    assert re.match(r"data mixture of code 75%, synthetic 25% \(1 later phase\): ", mixture.lines[1]), mixture.lines
    weighed = plan_of(["--job.config_file", str(ROOT / "train_configs" / "debug_mixture.toml"), "--job.dump_folder",
                       str(tmp_path), "--mixture.weights", "code=1,synthetic=1"], peak=None)
    assert weighed.lines[1].startswith("data mixture of code 50%, synthetic 50% (1 later phase): ")


def test_a_finished_run_has_nothing_to_do_before_any_worker(tmp_path):
    train_in_process(tmp_path, "--training.steps", "2", "--checkpoint.enable")
    argv = ["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path), "--checkpoint.enable"]
    assert plan_of([*argv, "--training.steps", "2"], peak=None).nothing_to_do == (
        f"the checkpoint {tmp_path / 'checkpoint' / 'step-2'} is at step 2 and training.steps is 2: nothing to do "
        "(raise training.steps to extend the run)")
    assert plan_of([*argv, "--training.steps", "3"], peak=None).nothing_to_do == ""
    assert torch.cuda.is_available() is False  # the suite's machines: the CPU bound above is the one they get


def test_the_last_line_names_the_checkpoint_of_the_last_step_in_every_replica_group(tmp_path):
    """The writing group's save of step 40, the run's last, is still being written (step-40.tmp) when the other
    group ends: that one names step-40 as the writing group's, where it used to name the folder's newest complete
    checkpoint, step-30. A job that writes lists the folder once its own save is closed: step-40."""
    cfg = load_config(["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path), "--checkpoint.enable",
                       "--training.steps", "40"])
    folder = tmp_path / "checkpoint"
    (folder / "step-30").mkdir(parents=True)
    (folder / "step-30" / ".metadata").touch()
    (folder / "step-40.tmp").mkdir()  # its .metadata, written last, not yet
    named = re.compile(r"; checkpoint ([^;]+);")
    assert named.findall(ending(cfg, 31, 40, 5.0, {}, writes=False)) == [
        f"{folder / 'step-40'} (the writing replica group's)"]
    (folder / "step-40.tmp" / ".metadata").touch()
    (folder / "step-40.tmp").rename(folder / "step-40")
    assert named.findall(ending(cfg, 31, 40, 5.0, {})) == [str(folder / "step-40")]


def test_a_warmup_longer_than_the_run_is_said_before_it_starts_and_one_sequence_is_singular(tmp_path):
    """A TOML that leaves warmup_steps at 200 for a 6-step run warmed up over the whole run, silently."""
    argv = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--job.dump_folder",
            str(tmp_path / "d"), "--training.steps", "6", "--lr_scheduler.warmup_steps", "200"]
    plan = plan_of(argv, peak=None)
    assert plan.warnings == [
        "lr_scheduler.warmup_steps 200 is more than training.steps 6: the warmup is cut to the run's 6 steps (the lr "
        "reaches its peak at the last step); set warmup_steps to what the run should warm up over"]
    assert plan_of([*argv, "--lr_scheduler.warmup_steps", "6"], peak=None).warnings == []
    one = plan_of([*argv, "--training.local_batch_size", "1", "--parallelism.tensor_parallel_degree", "1"],
                  world_size=1, peak=None).lines[1]
    assert "(1 sequence a rank per micro-batch," in one, one


def test_a_model_its_hugging_face_export_would_refuse_is_warned_of_before_it_trains(tmp_path):
    """What the export refuses only after training (scripts/convert_to_hf.py): a setting the model's HF layout cannot
    hold, named in one warning at start-up, for each model through its spec's adapter; none where the export works."""
    def export_warnings(*overrides):
        plan = plan_of(["--job.config_file", str(TINY), "--job.dump_folder", str(tmp_path), *overrides], world_size=1,
                       peak=None)
        return [w for w in plan.warnings if "Hugging Face export" in w]

    assert export_warnings("--model.flavor", "tiny_moe", "--moe.load_balance_coeff", "1e-3") == [
        "the Hugging Face export (scripts/convert_to_hf.py) will refuse this run's checkpoints: Mixtral's layout cannot "
        "hold moe.load_balance_coeff = 0.001 (Mixtral's: 0.0): a mixture of experts exports only with Mixtral's "
        "routing"]
    qwen = export_warnings("--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--moe.shared_experts", "1")
    assert len(qwen) == 1 and "Qwen3-MoE's layout cannot hold moe.shared_experts = 1" in qwen[0], qwen
    assert export_warnings("--model.flavor", "tiny_moe") == []  # Mixtral's routing, its auxiliary loss included
    assert export_warnings("--model.name", "qwen3", "--model.flavor", "debugmodel_moe") == []
    assert export_warnings("--model.flavor", "tiny") == []
