"""Validation logs a held-out loss and leaves the training curve exactly as it was."""

import pytest

from launch import read_metrics

pytestmark = pytest.mark.reads("resumed_4p")  # tp2_fsdp2_resumed


def test_validation_is_logged_and_does_not_perturb_training(runs):
    # The shared TP 2 x FSDP 2 run, stopped after step 4 and resumed with validation every 2 steps (conftest.py).
    straight, validated = read_metrics(runs["tp2_fsdp2"]), read_metrics(runs["tp2_fsdp2_resumed"])
    val = {m["step"]: m["val_loss"] for m in validated if "val_loss" in m}
    assert sorted(val) == [6, 8] and val[8] < val[6]
    # Step 7 and 8 train after the validation of step 6, on the same numbers as the run that never validated.
    assert [m["loss"] for m in validated if "loss" in m] == [m["loss"] for m in straight]
