"""A sharded run starts from a Hugging Face folder (checkpoint.initial_load_in_hf, checkpoint/hf_load.py): each rank
cuts its own pieces of the folder's tensors, and TP 2's first loss and grad norm are one process's, to reduction
order; so are PP 2's from a Qwen3 folder with tied embeddings (no lm_head.weight: the last stage's table comes from
the embedding's tensor). tests/test_hf_load.py checks one process's weights against the folder's bit for bit."""

import pytest
from launch import curve, torchrun, train_in_process

from tests.test_hf_load import hf_folder


def test_a_tensor_parallel_run_starts_from_a_hugging_face_folder_as_one_process_does(tmp_path):
    folder = hf_folder(tmp_path / "hf")
    start = ("--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(folder), "--training.steps", "1")
    train_in_process(tmp_path / "one", *start)
    train_in_process(tmp_path / "fresh", "--training.steps", "1")  # from the run's own init: another grad norm
    tp = torchrun(2, tmp_path / "tp2", *start, "--parallelism.tensor_parallel_degree", "2")
    assert f"loaded weights from {folder} (a Hugging Face folder" in tp.stdout + tp.stderr
    (one, one_norm), (fresh, fresh_norm), (sharded, sharded_norm) = (
        curve(tmp_path / run)[1] for run in ("one", "fresh", "tp2"))
    print(f"step 1's loss and grad norm: one process {one:.6f} {one_norm:.5f}, TP 2 {sharded:.6f} "
          f"{sharded_norm:.5f}; from the run's own init {fresh:.6f} {fresh_norm:.5f}")
    assert sharded == pytest.approx(one, abs=1e-5) and sharded_norm == pytest.approx(one_norm, rel=1e-5)
    assert one_norm != pytest.approx(fresh_norm, rel=0.1)


def test_a_pipelined_run_starts_from_a_tied_qwen3_folder_as_one_process_does(tmp_path):
    folder = hf_folder(tmp_path / "hf", flavor="debugmodel", model="qwen3")
    start = ("--model.name", "qwen3", "--model.flavor", "debugmodel", "--checkpoint.initial_load_in_hf",
             "--checkpoint.initial_load_path", str(folder), "--training.steps", "1")
    train_in_process(tmp_path / "one", *start)
    pp = torchrun(2, tmp_path / "pp2", *start, "--parallelism.pipeline_parallel_degree", "2")
    assert f"loaded weights from {folder} (a Hugging Face folder" in pp.stdout + pp.stderr
    (one, one_norm), (piped, piped_norm) = (curve(tmp_path / run)[1] for run in ("one", "pp2"))
    assert piped == pytest.approx(one, abs=1e-5) and piped_norm == pytest.approx(one_norm, rel=1e-5)
