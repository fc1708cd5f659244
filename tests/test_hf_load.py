"""A run that starts from a Hugging Face folder (checkpoint.initial_load_in_hf: torchtitan_lite/checkpoint/hf_load.py)
and saves its last checkpoint as one (checkpoint.last_save_in_hf), checked against folders transformers wrote: the
folder's weights are the run's at step 0 bit for bit, its tokenizer is the run's, the last save loads in transformers
with the trained weights, and what cannot work is refused by `train.py --check` in one line.
(tests/multiprocess/test_hf_load.py starts a sharded run from a folder.)"""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.multiprocess.launch import ckpt, tiny_model, train_in_process
from tests.test_hf import TOLERANCE, hf_model, load_ours, max_diff, random_tokens, randomize
from tests.test_tokenizer_json import qwen_style_folder
from torchtitan_lite.data.hf_tokenizer import folder_tokenizer, save_hf_tokenizer
from torchtitan_lite.data.tokenizer import STDLIB_BPE, Tokenizer
from torchtitan_lite.models import registry

transformers = pytest.importorskip("transformers")

START = ("--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path")
# A step at lr 1e-30 moves no fp32 weight (each update is far below half an ulp): the last save holds the first
# step's weights, which the export then shows.
FROZEN = ("--training.steps", "1", "--optimizer.lr", "1e-30")
LAST_IN_HF = ("--checkpoint.enable", "--checkpoint.last_save_in_hf")


def hf_folder(path, tokenizer=None, flavor="tiny", model="llama3", vocab_size=None):
    """A random model of tests/assets/tiny.toml's shape (or `model`'s `flavor`'s) made by transformers from the
    config.json our adapter writes, saved with save_pretrained, with the tokenizer (default byte level) as
    tokenizer.json; its embedding has the tokenizer's rows, or vocab_size's (padded, as Qwen's)."""
    tokenizer = tokenizer or Tokenizer.byte_level()
    spec = registry.get(model)
    args = dataclasses.replace(spec.flavors[flavor], vocab_size=vocab_size or tokenizer.n_words,
                               max_seq_len=tiny_model().max_seq_len)
    config = spec.hf.config(args, tokenizer.bos_id, tokenizer.eos_id, torch.float32)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    randomize(model).save_pretrained(path)
    save_hf_tokenizer(tokenizer, path)
    return path


def test_a_run_starts_from_the_folders_weights_and_tokenizer_and_its_last_save_gives_them_back(tmp_path):
    """A folder whose tokenizer is the project's BPE (2050 ids, not the byte-level 258 of a run that names none): the
    run takes it, builds a model of its vocabulary, and trains from the folder's weights, which its last save, after a
    step that moves none, writes back bit for bit."""
    folder = hf_folder(tmp_path / "hf", Tokenizer.from_file(STDLIB_BPE))
    run = train_in_process(tmp_path / "run", *START, str(folder), *FROZEN, *LAST_IN_HF)
    assert f"starting from {folder} (a Hugging Face folder)" in run.stdout
    assert f"loaded weights from {folder} (a Hugging Face folder: all 21 tensors of the model)" in run.stdout
    out = ckpt(tmp_path / "run", 1).with_name("step-1-hf")
    assert f"saved the last checkpoint as the Hugging Face folder {out}" in run.stdout
    theirs, back = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert theirs.keys() == back.keys() and len(back) == 21
    for name in theirs:
        assert torch.equal(theirs[name], back[name]), name
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 2050
    # Extended, the run resumes its own checkpoint, with the folder's tokenizer still, and converts its new last save.
    run = train_in_process(tmp_path / "run", *START, str(folder), *LAST_IN_HF, "--training.steps", "2")
    assert f"loaded full state from {ckpt(tmp_path / 'run', 1)}" in run.stdout
    assert "Hugging Face folder:" not in run.stdout
    assert json.loads((out.with_name("step-2-hf") / "config.json").read_text())["vocab_size"] == 2050


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory):
    """A folder as Qwen's: tokenizer.json with its own regex, NFC, added tokens and no BOS (1005 ids here), which
    `tokenizers` made, and config.json's vocab_size beyond them (1024 rows; Qwen3's: 151936 for 151669 ids)."""
    path = tmp_path_factory.mktemp("qwen_style")
    tokenizer = qwen_style_folder(path / "tokenizer")
    folder = hf_folder(path / "hf", folder_tokenizer(tokenizer), vocab_size=1024)
    (folder / "special_tokens_map.json").unlink()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the files as `tokenizers` wrote them, not our export
        shutil.copy(tokenizer / name, folder / name)
    (path / "doc.txt").write_text("".join(f"<|im_start|>user\nQ{i}: 12345 + café?<|im_end|>\n" for i in range(300)))
    return folder, path / "doc.txt"


def test_a_folder_that_pads_its_vocabulary_starts_a_run_of_its_size_with_its_tokenizer(tmp_path, qwen_style):
    folder, text = qwen_style
    run = train_in_process(tmp_path / "run", *START, str(folder), *FROZEN, *LAST_IN_HF, "--training.dataset", "text",
                           "--training.dataset_path", str(text))
    assert f"loaded weights from {folder} (a Hugging Face folder: all 21 tensors of the model)" in run.stdout
    out = ckpt(tmp_path / "run", 1).with_name("step-1-hf")
    theirs, back = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert back["model.embed_tokens.weight"].shape[0] == 1024
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 1024
    for name in theirs:
        assert torch.equal(theirs[name], back[name]), name
    assert folder_tokenizer(out).identity == folder_tokenizer(folder).identity


def test_block_causal_is_refused_without_a_bos(error_line, qwen_style):
    folder, text = qwen_style
    assert "block_causal masks at document starts (BOS), and the tokenizer has no BOS" in error_line(1, [
        *START, str(folder), "--model.attn_mask_type", "block_causal", "--training.dataset", "text",
        "--training.dataset_path", str(text)])


def test_the_last_save_in_hf_is_the_trained_model_in_transformers(tmp_path):
    """From a weights-only last save this time (the test above converts a full one)."""
    run = train_in_process(tmp_path / "run", "--training.steps", "2", *LAST_IN_HF, "--checkpoint.last_save_model_only")
    out = ckpt(tmp_path / "run", 2).with_name("step-2-hf")
    assert f"saved the last checkpoint as the Hugging Face folder {out}" in run.stdout
    trained = load_ours(ckpt(tmp_path / "run", 2), tiny_model())
    diff = max_diff(trained, hf_model(out), random_tokens(48))
    print(f"logits max |ours at step 2 - transformers' of step-2-hf|: {diff:.3g}")
    assert diff <= TOLERANCE


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("hf") / "tiny")


def changed(folder, tmp_path, config=None, drop=None):
    """A copy of `folder` with config.json's keys updated from `config`, or without the tensor `drop`."""
    copy = tmp_path / "changed"
    shutil.copytree(folder, copy)
    if config:
        (copy / "config.json").write_text(json.dumps({**json.loads((copy / "config.json").read_text()), **config}))
    if drop:
        weights = load_file(copy / "model.safetensors")
        save_file({k: v for k, v in weights.items() if k != drop}, copy / "model.safetensors", {"format": "pt"})
    return copy


def test_check_refuses_options_that_cannot_work(error_line):
    assert "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path" in error_line(
        1, ["--checkpoint.initial_load_in_hf"])
    assert "checkpoint.last_save_in_hf converts the last checkpoint: set checkpoint.enable" in error_line(
        1, ["--checkpoint.last_save_in_hf"])
    assert ("checkpoint.last_save_in_hf: Mixtral's layout cannot hold moe.load_balance_coeff = 0.001") in error_line(
        1, ["--model.flavor", "tiny_moe", "--moe.load_balance_coeff", "0.001", *LAST_IN_HF])


def test_check_refuses_a_model_without_a_hugging_face_adapter(error_line, folder, monkeypatch):
    monkeypatch.setitem(registry.SPECS, "no_hf", dataclasses.replace(registry.get("llama3"), name="no_hf", hf=None))
    assert "checkpoint.initial_load_in_hf: model no_hf has no Hugging Face adapter" in error_line(
        1, ["--model.name", "no_hf", *START, str(folder)])


@pytest.mark.parametrize("flavor, config, drop, expected", [
    ("debugmodel", None, None, "describes another model than model.name llama3, model.flavor debugmodel: "
     "layers.2.attention_norm.weight is absent there, (256,) here: set model.flavor tiny"),
    ("tiny", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, None,
     "rope_theta is 10000.0 there, 500000 here"),
    ("tiny", {"rms_norm_eps": 1e-6}, None, "rms_norm_eps is 1e-06 there, 1e-05 here"),
    ("tiny", None, "model.layers.1.mlp.down_proj.weight", "has no model.layers.1.mlp.down_proj.weight (1 tensors "
     "missing)"),
    ("tiny", {"vocab_size": 200}, None, "config.json's vocab_size is 200 but the folder's tokenizer (byte level where "
     "it has none) has 258 ids: set model.tokenizer_path to a tokenizer of at most 200 ids"),
])
def test_check_refuses_a_folder_of_another_model(error_line, folder, tmp_path, flavor, config, drop, expected):
    line = error_line(1, ["--model.flavor", flavor, *START, str(changed(folder, tmp_path, config, drop))])
    assert line.startswith("error: checkpoint.initial_load_path: ") and expected in line, line


def test_check_names_the_tokenizer_when_the_vocabularies_differ(error_line, folder):
    assert "vocab_size is 258 but model.tokenizer_path's tokenizer has 2050 ids: set it to \"\" to use the folder's " \
           "own, or to a tokenizer of at most 258 ids" in error_line(
        1, ["--model.tokenizer_path", str(STDLIB_BPE), *START, str(folder)])


def test_check_says_which_kind_of_folder_the_initial_load_path_is(error_line, folder, tmp_path):
    assert f"{folder} has no .metadata (not a complete DCP checkpoint): it holds config.json, so set " \
           "checkpoint.initial_load_in_hf" in error_line(1, ["--checkpoint.initial_load_path", str(folder)])
    assert f"{tmp_path} has no config.json (not a Hugging Face folder)" in error_line(1, [*START, str(tmp_path)])
    assert "a Hugging Face folder holds weights alone: set checkpoint.initial_load_model_only" in error_line(
        1, [*START, str(folder), "--no-checkpoint.initial_load_model_only"])
