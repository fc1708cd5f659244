"""A second architecture is a folder and a spec, not edits across the layers: a toy model that is no Llama
(toy_model.py), registered by the process that calls train.run(), trains through the normal entry point on TP 2 and
gives its own single-process curve. TP is the layout that reads the most of a model (its plan, the sizes the plan
splits): a layer still assuming Llama would look for modules the toy does not have. The checkpoint holds the toy's
parameters under its own names."""

from pathlib import Path

from launch import TP2, assert_same_curve, ckpt, losses, torchrun, train_in_process
from toy_model import TOY
from torchtitan_lite.checkpoint.reader import read_metadata
from torchtitan_lite.models import registry

SHIM = Path(__file__).parent / "toy_model.py"
STEPS = 6
TOY_RUN = ("--model.name", "toy", "--training.steps", str(STEPS), "--optimizer.lr", "1e-2", "--checkpoint.enable")
TOLERANCE = 1e-5  # TP's partial sums reduce in another order than one process's matmuls (test_layouts.py)


def test_a_registered_toy_model_trains_on_tp2_as_on_one_process(tmp_path, monkeypatch):
    monkeypatch.setitem(registry.SPECS, TOY.name, TOY)  # this process's runs; the shim registers it in the workers
    train_in_process(tmp_path / "single", *TOY_RUN)
    job = torchrun(2, tmp_path / "tp2", *TOY_RUN, *TP2, script=SHIM)
    assert "toy tiny: 0.10M parameters, mesh tp 2 on 2 processes" in job.stdout + job.stderr
    curve = losses(tmp_path / "single")
    assert sorted(curve) == list(range(1, STEPS + 1)) and curve[STEPS] < curve[1] - 0.5
    assert_same_curve(tmp_path / "tp2", tmp_path / "single", TOLERANCE)
    saved = {k for k in read_metadata(str(ckpt(tmp_path / "tp2", STEPS))).state_dict_metadata if k.startswith("model.")}
    with_names = {f"model.{name}" for name, _ in TOY.model_class(TOY.args("tiny", 258, 64)).named_parameters()}
    assert saved == with_names and "model.layers.1.up.weight" in saved
