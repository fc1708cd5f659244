"""Training on real text: JSON lines and pre-tokenized shards train, feed the model the same stream, and a stopped
run resumes with the exact next samples, also on another data-parallel degree (a real torchrun job, for shards).
The one-process runs run in this process: the launcher is not what these tests are about."""

import json
import shutil
import subprocess
import sys

import pytest

from launch import ROOT, TINY, assert_same_curve, losses, read_metrics, torchrun_several, train_in_process
from torchtitan_lite.data.files import stdlib_files

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """~400 KB of the standard library as JSON lines (one document per file), and the same as byte-level shards."""
    folder = tmp_path_factory.mktemp("data")
    lines, size = [], 0
    for f in stdlib_files()[::10]:
        text = f.read_text(errors="replace")
        lines.append(json.dumps({"content": text}))
        size += len(text)
        if size > 400_000:
            break
    (folder / "docs.jsonl").write_text("\n".join(lines) + "\n")
    subprocess.run([sys.executable, str(ROOT / "scripts/pretokenize.py"), "--dataset", "jsonl", "--text_field",
                    "content", "--dataset_path", str(folder / "docs.jsonl"), "--tokenizer_path", "",
                    "--output", str(folder / "tokens"), "--workers", "1"], check=True, capture_output=True)
    # The tests' config on the shards and synthetic data, 3:1 and then 1:1 from step 6 on: a resume at step 4
    # crosses the phase.
    (folder / "mixture.toml").write_text(TINY.read_text().replace('dataset = "synthetic"', 'dataset = "mixture"') +
        f'[[mixture.sources]]\nname = "docs"\ndataset = "tokens"\ndataset_path = "{folder / "tokens"}"\n'
        f'weight = 3\n[[mixture.sources]]\nname = "synthetic"\ndataset = "synthetic"\n'
        f'[[mixture.phases]]\nstart_step = 6\nweights = {{docs = 1, synthetic = 1}}\n')
    return {
        "jsonl": ["--training.dataset", "jsonl", "--training.dataset_path", str(folder / "docs.jsonl"),
                  "--training.dataset_text_field", "content"],
        "tokens": ["--training.dataset", "tokens", "--training.dataset_path", str(folder / "tokens")],
        "mixture": ["--job.config_file", str(folder / "mixture.toml")],
    }


# Global batch 4 on every layout: 1 process accumulates 2 micro-batches, FSDP 2 runs one each.
BATCH = ("--training.global_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "4")


@pytest.fixture(scope="module")
def straight_runs(data, tmp_path_factory):
    """8 steps on 1 process for each format, saving a checkpoint every 4 steps when the trainer can."""
    runs = {}
    for name, args in data.items():
        runs[name] = tmp_path_factory.mktemp(f"straight_{name}")
        train_in_process(runs[name], *args, *BATCH)
    return runs


def test_jsonl_and_shards_train_on_the_same_stream(straight_runs):
    jsonl = losses(straight_runs["jsonl"])
    assert sorted(jsonl) == list(range(1, 9))
    assert_same_curve(straight_runs["jsonl"], straight_runs["tokens"], 1e-6)  # the same windows, order: the same run
    assert jsonl[8] < jsonl[1] - 1.0, jsonl  # real text is learnable: bytes' frequencies alone take ~1.5 nats


RESUMES = {"jsonl": 1, "tokens": 2, "mixture": 2}  # format -> processes of the resumed run


@pytest.fixture(scope="module")
def resumed_runs(data, straight_runs, tmp_path_factory):
    """Each format's straight run stopped after step 4 (its dump with only its step-4 checkpoint), resumed to 8: on
    1 process here, on FSDP 2 in one 2-process job (several_runs.py) for both formats that resume there."""
    runs = {name: tmp_path_factory.mktemp(f"resumed_{name}") for name in RESUMES}
    for name, folder in runs.items():
        shutil.copytree(straight_runs[name] / "checkpoint" / "step-4", folder / "checkpoint" / "step-4")
    train_in_process(runs["jsonl"], *data["jsonl"], *BATCH)
    torchrun_several(2, [(runs[name], False, (*data[name], *BATCH)) for name, n in RESUMES.items() if n == 2])
    return runs


@pytest.mark.parametrize("name, tolerance", [
    ("jsonl", 1e-6),  # same layout: the same numbers
    ("tokens", 1e-5),  # dp 1 -> FSDP 2: other reduction order, same samples
    ("mixture", 1e-5),  # the same, on a mixture across its phase boundary at step 6
])
def test_stopped_run_resumes_with_the_next_samples(resumed_runs, straight_runs, name, tolerance):
    tmp_path = resumed_runs[name]
    assert sorted(losses(tmp_path)) == [5, 6, 7, 8]
    assert_same_curve(tmp_path, straight_runs[name], tolerance)
    if name == "mixture":  # each source's loss too, measured where the sequences are, not where they were on 1 rank
        straight = {m["step"]: m for m in read_metrics(straight_runs[name])}
        for m in read_metrics(tmp_path):
            for key in ("loss/docs", "loss/synthetic", "tokens/docs", "epochs/docs"):
                assert abs(m[key] - straight[m["step"]][key]) <= tolerance * abs(m[key]), (m["step"], key)


def test_a_mixtures_source_losses_add_up_to_its_loss(straight_runs):
    # Global batch 4: docs and synthetic 3:1 (quotas 3 and 1) up to step 6, then 1:1 (2 and 2); 64 tokens a window.
    for m in read_metrics(straight_runs["mixture"]):
        quotas = (3, 1) if m["step"] <= 6 else (2, 2)
        mixed = (quotas[0] * m["loss/docs"] + quotas[1] * m["loss/synthetic"]) / 4
        assert abs(mixed - m["loss"]) <= 1e-6 * m["loss"], m
        taken = 3 * min(m["step"], 6) + 2 * max(0, m["step"] - 6)
        assert m["tokens/docs"] == taken * 64 and m["tokens/synthetic"] == (m["step"] * 4 - taken) * 64
        assert "epochs/synthetic" not in m  # endless
