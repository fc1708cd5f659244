"""Validation logs a held-out loss and leaves the training curve exactly as it was."""

from launch import read_metrics, torchrun


def test_validation_is_logged_and_does_not_perturb_training(tmp_path):
    tp2 = ["--parallelism.tensor_parallel_degree", "2", "--training.steps", "6"]
    plain = torchrun(4, tmp_path / "plain", *tp2) and read_metrics(tmp_path / "plain")
    torchrun(4, tmp_path / "val", *tp2, "--validation.enable", "--validation.freq", "3", "--validation.steps", "2")
    with_val = read_metrics(tmp_path / "val")
    assert [m["loss"] for m in with_val] == [m["loss"] for m in plain]
    val = {m["step"]: m["val_loss"] for m in with_val if "val_loss" in m}
    assert sorted(val) == [3, 6] and val[6] < val[3]
