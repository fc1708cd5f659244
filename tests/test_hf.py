"""Hugging Face export and import (torchtitan_lite/tools/hf_convert.py, scripts/convert_{to,from}_hf.py), checked against
transformers' own Llama as litgpt checks its conversions: the same weights must give the same logits there and here.

Every model has random weights at a scale that gives logits of order 1, norm weights included (they start at 1,
where a misplaced norm would go unnoticed), so a 1e-5 tolerance can only pass with every tensor in its place.
"""

import importlib.util
import json
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.multiprocess.launch import ROOT, TINY, ckpt, tiny_model, train_in_process
from torchtitan_lite.checkpoint.reader import read_tensors
from torchtitan_lite.config import load_config, to_toml
from torchtitan_lite.data.hf_tokenizer import save_hf_tokenizer
from torchtitan_lite.data.tokenizer import Tokenizer
from torchtitan_lite.models.llama3.hf import model_args_from_hf
from torchtitan_lite.models.llama3.model import ModelArgs, Transformer
from torchtitan_lite.tools.hf_convert import export_to_hf, import_from_hf

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5
BYTES, BOS, EOS = 258, 256, 257  # the byte-level tokenizer's vocabulary and ids
CASES = {
    "mha": ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=BYTES, multiple_of=32),
    "gqa": ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=BYTES, multiple_of=32),
    # 256 positions with theta 500000: the rotations of the low frequencies that Llama 3.1 slows 8x reach ~0.1 rad.
    "rope_scaling": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=BYTES, rope_theta=500000.0,
                              rope_scaling=True, max_seq_len=256),
}


def script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


to_hf, from_hf = script("convert_to_hf"), script("convert_from_hf")


@torch.no_grad()
def randomize(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:  # RMSNorm weights
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


def ours(args, seed=0):
    return randomize(Transformer(args), seed).eval()


def save_run_checkpoint(model, path):
    """Our model as the trainer saves it: `model.*` plus other state, which an export must leave out."""
    state = {"model": model.state_dict(), "optimizer": {"state": {"output.weight": {"exp_avg": torch.ones(3)}}},
             "train_state": {"step": 7}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def random_tokens(length, seed=0):
    return torch.randint(0, BYTES, (2, length), generator=torch.Generator().manual_seed(seed))


def hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def max_diff(model_a, model_b, tokens):
    a, b = model_a(tokens), model_b(tokens)
    a, b = getattr(a, "logits", a), getattr(b, "logits", b)
    assert a.abs().max() > 1  # logits of order 1: the tolerance below is small next to them
    return (a - b).abs().max().item()


def load_ours(dcp_folder, args):
    model = Transformer(args).eval()
    model.load_state_dict({k.removeprefix("model."): v for k, v in read_tensors(str(dcp_folder)).items()})
    return model


def assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]) and a[key].dtype == b[key].dtype, key


@pytest.mark.parametrize("case", CASES)
def test_export_gives_transformers_our_logits(tmp_path, case):
    args = CASES[case]
    model = ours(args)
    export_to_hf(save_run_checkpoint(model, tmp_path / "ckpt"), tmp_path / "hf", args, BOS, EOS)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["intermediate_size"], config["num_key_value_heads"]) == (args.ffn_hidden, args.kv_heads)
    assert (config["bos_token_id"], config["eos_token_id"], config["tie_word_embeddings"]) == (BOS, EOS, False)
    tokens = random_tokens(args.max_seq_len if args.rope_scaling else 48)
    diff = max_diff(model, hf_model(tmp_path / "hf"), tokens)
    print(f"logits max |ours - transformers|, {case}: {diff:.3g}")
    assert diff <= TOLERANCE
    if args.rope_scaling:  # the case exercises the scaling: without it the logits move far beyond the tolerance
        unscaled = Transformer(args.with_(rope_scaling=False)).eval()
        unscaled.load_state_dict(model.state_dict())
        scaling = max_diff(model, unscaled, tokens)
        print(f"logits max |with - without rope scaling|: {scaling:.3g}")
        assert scaling > 100 * TOLERANCE


def hf_folder(path, tie=False, **config):
    """A random LlamaForCausalLM made by transformers, saved with save_pretrained."""
    settings = {"vocab_size": BYTES, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 5000.0, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": tie, "max_position_embeddings": 64}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**settings, **config}))
    randomize(model).save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_import_gives_us_transformers_logits(tmp_path, tie, capsys):
    reference = hf_folder(tmp_path / "hf", tie=tie)
    assert from_hf.main([str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert "add it to FLAVORS" in capsys.readouterr().out  # intermediate_size 160 is no flavor's
    args = model_args_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert args.ffn_hidden == 160  # not the default rounding of dim 64 (192): found another multiple_of
    diff = max_diff(load_ours(tmp_path / "ckpt", args), reference, random_tokens(48))
    print(f"logits max |ours - transformers|, import {'tied' if tie else 'untied'}: {diff:.3g}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bitwise(tmp_path, dtype):
    args = CASES["gqa"]
    model = ours(args)
    export_to_hf(save_run_checkpoint(model, tmp_path / "ckpt"), tmp_path / "hf", args, BOS, EOS, dtype=dtype)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == str(dtype)[6:]
    assert import_from_hf(tmp_path / "hf", tmp_path / "back").ffn_hidden == args.ffn_hidden  # back to float32
    expected = {f"model.{k}": v.to(dtype).float() for k, v in model.state_dict().items()}
    assert_same_tensors(read_tensors(str(tmp_path / "back")), expected)


def test_sharded_export_loads_the_same(tmp_path):
    args = CASES["gqa"]
    model = ours(args)
    path = save_run_checkpoint(model, tmp_path / "ckpt")
    export_to_hf(path, tmp_path / "one", args, BOS, EOS)
    export_to_hf(path, tmp_path / "sharded", args, BOS, EOS, max_shard_size=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(index["weight_map"]) == len(model.state_dict()) and not (tmp_path / "sharded/model.safetensors").exists()
    tokens = random_tokens(48)
    assert max_diff(hf_model(tmp_path / "one"), hf_model(tmp_path / "sharded"), tokens) == 0
    import_from_hf(tmp_path / "sharded", tmp_path / "back")  # the import reads the index too
    assert_same_tensors(read_tensors(str(tmp_path / "back")), {f"model.{k}": v for k, v in model.state_dict().items()})


def one_error_line(capsys, *expected):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and all(e in err[0] for e in expected), err
    return err[0]


@pytest.mark.parametrize("change, expected", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "MistralForCausalLM"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, "factor = 32.0"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}}, "yarn"),
    ({"head_dim": 32}, "head_dim"),
])
def test_import_refuses_what_our_model_cannot_represent(tmp_path, capsys, change, expected):
    hf_folder(tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bars
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    assert from_hf.main([str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    one_error_line(capsys, expected)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [tmp_path / "hf"]  # nothing half-written


def test_a_conversion_that_fails_midway_leaves_nothing(tmp_path, capsys):
    hf_folder(tmp_path / "hf", vocab_size=300)
    save_hf_tokenizer(Tokenizer.byte_level(), tmp_path / "hf")  # 258 ids: the trainer could not build this model
    capsys.readouterr()
    assert from_hf.main([str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    one_error_line(capsys, "the tokenizer has 258 ids but config.json's vocab_size is 300")
    assert list(tmp_path.iterdir()) == [tmp_path / "hf"]  # the temporary folder, tokenizer written, is gone too


def run_folder(tmp_path, model):
    """What a training run leaves: its config.toml and <dump_folder>/checkpoint/step-N."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text(to_toml(load_config(["--job.config_file", str(TINY)])))
    return save_run_checkpoint(model, ckpt(tmp_path / "run", 3))


def test_export_refuses_a_checkpoint_of_another_shape(tmp_path, capsys):
    path = run_folder(tmp_path, ours(CASES["mha"]))  # the config says tiny, of width 256
    assert to_hf.main([str(path), str(tmp_path / "hf")]) == 2
    one_error_line(capsys, "model.tok_embeddings.weight has shape (258, 64) in the checkpoint but shape (258, 256)")
    assert not (tmp_path / "hf").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("")
    assert to_hf.main([str(path), str(tmp_path / "taken"), "--config", str(TINY)]) == 2
    one_error_line(capsys, "already exists")


def test_export_takes_the_checkpoint_argument_of_generate_py(tmp_path, capsys):
    """A step-N folder, the checkpoint folder (its newest complete step) or the run's dump folder, the config found
    beside it; and when the run saved none, one line that says to train with --checkpoint.enable."""
    args = tiny_model()
    newest = run_folder(tmp_path, ours(args))  # step-3
    save_run_checkpoint(ours(args, seed=1), ckpt(tmp_path / "run", 2))  # older: other weights, never picked
    (tmp_path / "run" / "checkpoint" / "step-4.tmp").mkdir()  # a save in progress is not a checkpoint
    assert to_hf.main([str(newest), str(tmp_path / "hf")]) == 0
    for i, checkpoint in enumerate([newest.parent, tmp_path / "run"]):
        assert to_hf.main([str(checkpoint), str(tmp_path / f"hf{i}")]) == 0
        for name in ("config.json", "model.safetensors"):
            assert (tmp_path / f"hf{i}" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), checkpoint
    capsys.readouterr()
    # The README's command after a run of the default config, which saves no checkpoint.
    missing = tmp_path / "outputs" / "checkpoint" / "step-10"
    assert to_hf.main([str(missing), str(tmp_path / "hf_missing")]) == 2
    one_error_line(capsys, f"no checkpoint in {missing}: train with --checkpoint.enable")


def test_scripts_round_trip_a_run_and_the_trainer_starts_from_it(tmp_path):
    """convert_to_hf then convert_from_hf, run as users run them, then a training run from the result."""
    args = tiny_model()
    model = ours(args)
    path = run_folder(tmp_path, model)
    for cmd in (["convert_to_hf.py", path, tmp_path / "hf", "--max_shard_size", "5MB"],
                ["convert_from_hf.py", tmp_path / "hf", tmp_path / "imported"]):
        proc = subprocess.run([sys.executable, ROOT / "scripts" / cmd[0], *cmd[1:]], capture_output=True, text=True,
                              check=False)
        assert proc.returncode == 0, proc.stderr
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors.index.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}
    tokenizer = tmp_path / "imported" / "tokenizer.tiktoken"
    assert 'flavor = "tiny"' in proc.stdout and json.dumps(str(tokenizer)) in proc.stdout
    original = {f"model.{k}": v for k, v in model.state_dict().items()}
    assert_same_tensors(read_tensors(str(tmp_path / "imported")), original)
    # A step at lr 1e-30 moves no fp32 weight (each update is far below half an ulp), so the run's last save holds
    # exactly what it started from.
    run = train_in_process(tmp_path / "train", "--checkpoint.initial_load_path", str(tmp_path / "imported"),
                           "--model.tokenizer_path", str(tokenizer), "--training.steps", "1", "--optimizer.lr",
                           "1e-30", "--checkpoint.enable", "--checkpoint.last_save_model_only")
    assert f"loaded weights from {tmp_path / 'imported'}" in run.stdout
    assert_same_tensors(read_tensors(str(ckpt(tmp_path / "train", 1))), original)


def test_an_exported_run_generates_in_transformers_the_greedy_text_of_generate_py(tmp_path):
    """The issue's end to end: a debug run's checkpoint, exported, decodes greedily in transformers to the text that
    scripts/generate.py prints (our KV-cached decoding on the DCP checkpoint)."""
    train_in_process(tmp_path / "run", "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "6")
    assert to_hf.main([str(ckpt(tmp_path / "run", 6)), str(tmp_path / "hf")]) == 0
    prompt, n = "def __init__(self", 24
    ours_out = subprocess.run(
        [sys.executable, ROOT / "scripts" / "generate.py", "--config", tmp_path / "run" / "config.toml", "--checkpoint",
         tmp_path / "run" / "checkpoint", "--prompt", prompt, "--max_new_tokens", str(n), "--temperature", "0"],
        capture_output=True, text=True, check=True).stdout
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    inputs = tokenizer(prompt, return_tensors="pt")
    assert inputs["input_ids"][0, 0] == BOS  # the exported tokenizer adds BOS, as our data and generate.py do
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf_model(tmp_path / "hf").generate(**inputs, max_new_tokens=n, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    theirs = prompt + tokenizer.decode(new, skip_special_tokens=True)
    assert ours_out == theirs + "\n" and len(theirs) > len(prompt)


def test_export_of_a_corrupt_checkpoint_is_one_error_line(tmp_path, capsys):
    path = run_folder(tmp_path, ours(CASES["mha"]))
    (path / ".metadata").write_bytes(b"\x80\x04not a pickle")
    assert to_hf.main([str(path), str(tmp_path / "hf")]) == 2
    one_error_line(capsys, f"{path / '.metadata'} cannot be read")
    assert not (tmp_path / "hf").exists()
