"""generation.py and scripts/generate.py: the KV cache decodes exactly what the model's own forward does, generation
stops at EOS and at max_new_tokens, and a checkpoint of a real run turns into text, the same text for the same
seed."""

import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

from tests.multiprocess.launch import ROOT, TIMEOUT_S, ckpt, train_in_process
from torchtitan_lite.checkpoint import reader as checkpoint_reader
from torchtitan_lite.checkpoint.finder import checkpoint_and_config
from torchtitan_lite.checkpoint.reader import read_tensors
from torchtitan_lite.config import load_config
from torchtitan_lite.models.common.decoder import TransformerBlock
from torchtitan_lite.models.common.kv_cache import KVCache
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
from torchtitan_lite.tools.generation import (
    ContextError,
    forward_cached,
    generate,
    load_model,
    sample,
)

import generate as generate_script  # scripts/generate.py (pytest.ini puts scripts/ on the path)

SCRIPT = ROOT / "scripts" / "generate.py"

VOCAB, EOS = 258, 257  # the byte-level tokenizer's: 256 bytes, BOS, EOS


def tiny_model(n_kv_heads=None, max_seq_len=32):
    args = FLAVORS["debugmodel"].with_(dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, multiple_of=32,
                                       vocab_size=VOCAB, max_seq_len=max_seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model.eval()


@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
def test_cached_logits_equal_the_full_forward_at_every_position(n_kv_heads):
    model = tiny_model(n_kv_heads)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model, batch=2, max_len=24)
    # A prefill, single-token steps (each at its own rope position), then a chunk after cached positions.
    logits = [forward_cached(model, tokens[:, :8], cache)]
    logits += [forward_cached(model, tokens[:, t:t + 1], cache) for t in range(8, 20)]
    logits.append(forward_cached(model, tokens[:, 20:], cache))
    with torch.no_grad():
        full = model(tokens)
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (1.0, 50)], ids=["greedy", "sampled"])
def test_cached_and_uncached_decoding_give_the_same_tokens(n_kv_heads, temperature, top_k):
    model, prompt = tiny_model(n_kv_heads), [256, 72, 105, 33]

    def decode(use_cache, seed=1):
        return generate(model, prompt, 20, temperature, top_k, generator=torch.Generator().manual_seed(seed),
                        use_cache=use_cache)

    cached = decode(use_cache=True)
    assert len(cached) == 20 and cached == decode(use_cache=False)
    if temperature:  # the comparison can fail: another seed draws other tokens
        assert decode(use_cache=True, seed=2) != cached


def test_top_k_draws_only_among_the_k_most_likely():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    top3 = set(logits.topk(3).indices[0].tolist())
    g = torch.Generator().manual_seed(0)
    drawn = {sample(logits, 5.0, 3, g).item() for _ in range(200)}
    assert drawn == top3
    assert sample(logits, 1.0, 1, g).item() == sample(logits, 0.0, None, g).item() == logits.argmax().item()


class ScriptedHead(nn.Module):
    """Stands in for model.output: at its n-th call, the argmax at every position is script[n]."""

    def __init__(self, script):
        super().__init__()
        self.script, self.calls = script, 0

    def forward(self, h):
        logits = torch.zeros(*h.shape[:-1], VOCAB)
        logits[..., self.script[self.calls]] = 1.0
        self.calls += 1
        return logits


@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "uncached"])
def test_stops_at_eos_and_after_max_new_tokens(use_cache):
    model = tiny_model()
    model.output = ScriptedHead([65, 66, EOS, 67, 68])
    assert generate(model, [256, 72], 10, eos_id=EOS, use_cache=use_cache) == [65, 66]  # EOS is not returned
    model.output = ScriptedHead([65, 66, 67, 68, EOS])
    assert generate(model, [256, 72], 3, eos_id=EOS, use_cache=use_cache) == [65, 66, 67]


def test_a_prompt_and_tokens_that_do_not_fit_the_context_are_refused():
    model = tiny_model(max_seq_len=16)
    prompt = [256] + [72] * 11
    assert len(generate(model, prompt, 4)) == 4  # exactly the context
    with pytest.raises(ContextError, match="16 tokens.*at most 4 new tokens"):
        generate(model, prompt, 5)


# ---- End to end: a real run's checkpoints, full state and weights only.

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """2 steps of the tests' config: step-1 full state, step-2 weights only in bfloat16."""
    folder = tmp_path_factory.mktemp("generate") / "run"
    train_in_process(folder, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "1",
                     "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16")
    return folder


def args(run, *extra):
    return ["--config", str(run / "config.toml"), "--prompt", "Hello", "--max_new_tokens", "8", *extra]


def test_script_prints_the_prompt_and_a_continuation_the_same_for_the_same_seed(run, capsysbinary):
    sampled = args(run, "--checkpoint", str(ckpt(run, 1)), "--temperature", "1", "--top_k", "50", "--seed", "3")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONIOENCODING": "utf-8"}
    # As a user runs it; bytes, since text mode would turn a generated "\r" into "\n".
    out = subprocess.run([sys.executable, str(SCRIPT), *sampled], env=env, cwd=ROOT, capture_output=True,
                         timeout=TIMEOUT_S, check=True).stdout
    assert out.startswith(b"Hello") and len(out.rstrip(b"\n")) > len(b"Hello")
    # The same seed again (in this process: a second interpreter costs seconds), then another seed.
    assert generate_script.main(sampled) == 0
    assert capsysbinary.readouterr().out == out
    assert generate_script.main([*sampled[:-1], "4"]) == 0
    assert capsysbinary.readouterr().out != out


def test_a_weights_only_bfloat16_checkpoint_loads_exactly(run):
    cfg = load_config(["--job.config_file", str(run / "config.toml")])
    # The checkpoint folder, not a step: the newest complete one, step-2, is used.
    model, _ = load_model(cfg, str(run / "checkpoint"), torch.device("cpu"))
    saved = read_tensors(str(ckpt(run, 2)))
    assert saved["model.output.weight"].dtype == torch.bfloat16 and not any(k.startswith("optimizer") for k in saved)
    state = model.state_dict()
    assert set(saved) == {f"model.{k}" for k in state}
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, saved[f"model.{name}"].float()), name


def test_errors_are_one_line_with_exit_status_2(run, capsys):
    full = args(run, "--checkpoint", str(ckpt(run, 1)), "--temperature", "0")
    assert generate_script.main([*full, "--max_new_tokens", "64"]) == 2  # 6 prompt tokens + 64 > 64
    assert capsys.readouterr().err.strip().startswith("error: the prompt is 6 tokens")
    # Another tokenizer (another vocabulary) than the run's: the checkpoint does not fit, and says which tensor.
    bpe = ROOT / "torchtitan_lite" / "assets" / "stdlib_bpe_2k.tiktoken"
    assert generate_script.main([*full, "--model.tokenizer_path", str(bpe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.tok_embeddings.weight has shape" in err[0]


def test_the_checkpoint_is_a_step_its_folder_or_the_dump_folder_and_the_config_is_the_one_it_holds(run, capsysbinary):
    """What convert_to_hf.py takes too (checkpoint_finder): a folder means its newest complete step, and without
    --config the config that wrote the checkpoint, which it holds, is used."""
    greedy = ["--prompt", "Hello", "--max_new_tokens", "8", "--temperature", "0"]
    assert generate_script.main(["--config", str(run / "config.toml"), "--checkpoint", str(ckpt(run, 2)), *greedy]) == 0
    expected = capsysbinary.readouterr().out
    (run / "checkpoint" / "step-3.tmp").mkdir()  # a save in progress is not a checkpoint
    for checkpoint in (ckpt(run, 2), run / "checkpoint", run):
        path, cfg = checkpoint_and_config(str(checkpoint))
        assert (path, cfg.job.config_file) == (str(ckpt(run, 2)), str(ckpt(run, 2) / "config.toml")), checkpoint
        assert generate_script.main(["--checkpoint", str(checkpoint), *greedy]) == 0, checkpoint
        assert capsysbinary.readouterr().out == expected, checkpoint
    (run / "checkpoint" / "step-3.tmp").rmdir()


def test_no_checkpoint_tells_to_train_with_checkpoint_enable(run, tmp_path, capsys):
    """The README's commands after a run of the default config, which saves none: one line saying so, exit 2."""
    (tmp_path / "outputs").mkdir()
    shutil.copy(run / "config.toml", tmp_path / "outputs")  # a run without --checkpoint.enable
    for missing in (tmp_path / "outputs", tmp_path / "outputs" / "checkpoint", ckpt(tmp_path / "outputs", 20)):
        assert generate_script.main(["--checkpoint", str(missing), "--prompt", "Hello"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: no checkpoint in {missing}: train with "
                                                   "--checkpoint.enable"), err
    shutil.copytree(ckpt(run, 1), tmp_path / "step-1")  # a checkpoint outside its run holds its config
    assert generate_script.main(["--checkpoint", str(tmp_path / "step-1"), "--prompt", "Hello"]) == 0
    capsys.readouterr()
    (tmp_path / "step-1" / "config.toml").unlink()  # as checkpoints saved before they held it: nothing beside it
    assert generate_script.main(["--checkpoint", str(tmp_path / "step-1"), "--prompt", "Hello"]) == 2
    assert capsys.readouterr().err.strip().endswith("pass --config FILE")


def test_a_corrupt_checkpoint_is_one_error_line(run, tmp_path, capsys):
    broken = tmp_path / "step-1"
    shutil.copytree(ckpt(run, 1), broken)
    metadata = broken / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])  # a copy cut short
    assert generate_script.main(args(run, "--checkpoint", str(broken))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {metadata} cannot be read"), err


def test_metadata_is_unpickled_once_per_load(run, tmp_path, monkeypatch):
    """By generation's load and by a resume: DCP's reader is handed the metadata read (through the allow-list)."""
    reads = []
    safe, plain = checkpoint_reader._MetadataUnpickler.load, pickle.load
    monkeypatch.setattr(checkpoint_reader._MetadataUnpickler, "load", lambda self: reads.append("safe") or safe(self))
    monkeypatch.setattr(pickle, "load", lambda f, *a, **k: (
        reads.append("plain") if str(getattr(f, "name", "")).endswith(".metadata") else None) or plain(f, *a, **k))
    load_model(load_config(["--job.config_file", str(run / "config.toml")]), str(ckpt(run, 1)), torch.device("cpu"))
    assert reads == ["safe"]
    reads.clear()
    shutil.copytree(ckpt(run, 1), ckpt(tmp_path, 1))
    log = train_in_process(tmp_path, "--training.steps", "2", "--checkpoint.enable").stdout
    assert "loaded full state" in log and reads == ["safe"]


def test_decoding_runs_the_models_own_blocks(monkeypatch):
    """The cache is an argument of the model's forward, not a copy of it: a change to the block's forward is one that
    decoding follows."""
    block_forward = TransformerBlock.forward
    monkeypatch.setattr(TransformerBlock, "forward", lambda *args, **kwargs: 0.5 * block_forward(*args, **kwargs))
    model = tiny_model()
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model, batch=1, max_len=12)
    logits = [forward_cached(model, tokens[:, :8], cache)]
    logits += [forward_cached(model, tokens[:, t:t + 1], cache) for t in range(8, 12)]
    with torch.no_grad():
        full = model(tokens)
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-5, rtol=0)
