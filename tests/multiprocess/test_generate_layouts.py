"""scripts/generate.py on checkpoints that 4 processes wrote, sharded by FSDP alone and by TP 2 x FSDP 2 (the shared
runs of conftest.py; no run of its own): one process loads exactly the saved weights, and the script's greedy text
is what a model holding those weights decodes."""

import pytest
import torch
from launch import STEPS, ckpt

from torchtitan_lite.checkpoint.reader import read_tensors
from torchtitan_lite.config import load_config
from torchtitan_lite.models.llama3.model import Transformer
from torchtitan_lite.tools.generation import generate, load_model

import generate as generate_script  # scripts/generate.py (pytest.ini puts scripts/ on the path)

PROMPT = "Hello"


@pytest.mark.parametrize("name", ["fsdp4", "tp2_fsdp2"])
def test_a_checkpoint_of_a_parallel_layout_generates_on_one_process(runs, name, capsysbinary):
    folder = runs[name]
    config = str(folder / "config.toml")  # the run's resolved config: 4 ranks' degrees, ignored here
    saved = read_tensors(str(ckpt(folder, STEPS)))
    weights = {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}

    # What the script loads is what DCP holds, tensor for tensor, bitwise.
    model, tokenizer = load_model(load_config(["--job.config_file", config]), str(ckpt(folder, STEPS)),
                                  torch.device("cpu"))
    state = model.state_dict()
    assert state.keys() == weights.keys()
    for key, tensor in state.items():
        assert torch.equal(tensor, weights[key]), key

    # A model given the same tensors by plain load_state_dict, decoding greedily, is the reference.
    with torch.device("meta"):
        reference = Transformer(model.args)
    reference.to_empty(device="cpu")
    reference.init_weights()  # the rope buffer; every parameter is then replaced
    reference.load_state_dict(weights)
    new = generate(reference.eval(), tokenizer.encode(PROMPT, bos=True, eos=False), 16, eos_id=tokenizer.eos_id)
    # The checkpoint folder: the script picks its newest complete step, STEPS.
    assert generate_script.main(["--config", config, "--checkpoint", str(folder / "checkpoint"), "--prompt", PROMPT,
                                 "--max_new_tokens", "16", "--temperature", "0"]) == 0
    assert capsysbinary.readouterr().out == (PROMPT + tokenizer.decode(new) + "\n").encode()
