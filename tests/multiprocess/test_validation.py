"""Validation logs a held-out loss and leaves the training curve exactly as it was."""

from launch import COMMON, STEPS, TP2_FSDP2, read_metrics, torchrun


def test_validation_is_logged_and_does_not_perturb_training(runs, tmp_path):
    # The shared TP 2 x FSDP 2 run again, validating every 4 steps.
    torchrun(4, tmp_path, *COMMON, "--training.steps", str(STEPS), *TP2_FSDP2, "--validation.enable",
             "--validation.freq", "4", "--validation.steps", "2")
    with_val = read_metrics(tmp_path)
    assert [m["loss"] for m in with_val] == [m["loss"] for m in read_metrics(runs["tp2_fsdp2"])]
    val = {m["step"]: m["val_loss"] for m in with_val if "val_loss" in m}
    assert sorted(val) == [4, 8] and val[8] < val[4]
