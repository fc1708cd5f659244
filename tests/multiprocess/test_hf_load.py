"""A sharded run starts from a Hugging Face folder (checkpoint.initial_load_in_hf, checkpoint/hf_load.py): each rank
cuts its own pieces of the folder's tensors, and TP 2's first loss and grad norm are one process's, to reduction
order; so are PP 2's from a Qwen3 folder with tied embeddings (no lm_head.weight: the last stage's table comes from
the embedding's tensor). tests/test_hf_load.py checks one process's weights against the folder's bit for bit."""

import pytest
from launch import PP2, TP2, curve, torchrun_several, train_in_process

from tests.test_hf_load import hf_folder


def start(folder, *model: str) -> tuple[str, ...]:
    """A 1-step run of `model`'s overrides that starts from the Hugging Face folder `folder`."""
    return (*model, "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(folder),
            "--training.steps", "1")


QWEN3 = ("--model.name", "qwen3", "--model.flavor", "debugmodel")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Both tests' sharded runs, in one 2-process job (a job costs seconds of start-up before its first step): TP 2
    from a folder of the tests' model, PP 2 from a tied Qwen3 folder. (Their root, folders by run, the job's output.)"""
    root = tmp_path_factory.mktemp("hf_load")
    folders = {"tp2": hf_folder(root / "hf"), "pp2": hf_folder(root / "hf_qwen3", flavor="debugmodel", model="qwen3")}
    runs = {"tp2": (*start(folders["tp2"]), *TP2), "pp2": (*start(folders["pp2"], *QWEN3), *PP2)}
    proc = torchrun_several(2, [(root / name, False, overrides) for name, overrides in runs.items()])
    return root, folders, proc.stdout + proc.stderr


def test_a_tensor_parallel_run_starts_from_a_hugging_face_folder_as_one_process_does(sharded, tmp_path):
    root, folders, output = sharded
    folder = folders["tp2"]
    train_in_process(tmp_path / "one", *start(folder))
    train_in_process(tmp_path / "fresh", "--training.steps", "1")  # from the run's own init: another grad norm
    assert f"loaded weights from {folder} (a Hugging Face folder" in output
    (one, one_norm), (fresh, fresh_norm), (tp, tp_norm) = (
        curve(path)[1] for path in (tmp_path / "one", tmp_path / "fresh", root / "tp2"))
    print(f"step 1's loss and grad norm: one process {one:.6f} {one_norm:.5f}, TP 2 {tp:.6f} {tp_norm:.5f}; from "
          f"the run's own init {fresh:.6f} {fresh_norm:.5f}")
    assert tp == pytest.approx(one, abs=1e-5) and tp_norm == pytest.approx(one_norm, rel=1e-5)
    assert one_norm != pytest.approx(fresh_norm, rel=0.1)


def test_a_pipelined_run_starts_from_a_tied_qwen3_folder_as_one_process_does(sharded, tmp_path):
    root, folders, output = sharded
    folder = folders["pp2"]
    train_in_process(tmp_path / "one", *start(folder, *QWEN3))
    assert f"loaded weights from {folder} (a Hugging Face folder" in output
    (one, one_norm), (piped, piped_norm) = (curve(path)[1] for path in (tmp_path / "one", root / "pp2"))
    assert piped == pytest.approx(one, abs=1e-5) and piped_norm == pytest.approx(one_norm, rel=1e-5)
