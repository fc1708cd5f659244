"""DeepSeek-V3's multi-token prediction (MTP) modules in Hugging Face folders (models/deepseek_v3/hf.py `bind`, through
tools/hf_convert.py and checkpoint/hf_load.py), as DeepSeek publishes them: module k is layer num_hidden_layers + k,
a decoder layer's tensors plus enorm, hnorm, eh_proj, shared_head.norm and copies of the embedding and lm_head.

Checked against the published names (layer 61 of 671B, layer 2 of the debug model), against transformers' MtpModel
(what its generate(use_mtp=True) drafts with), and both ways through the converters and a run's start and last save.
tests/test_hf_deepseek_v3.py round-trips the debug model, MTP module included, bit for bit.
"""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.multiprocess.launch import ckpt, tiny_model, train_in_process
from tests.test_hf import BOS, BYTES, EOS, TOLERANCE, save_run_checkpoint, script, transformers
from tests.test_hf_deepseek_v3 import BASE, SPEC, loaded, ours, tokens
from tests.test_hf_load import FROZEN, LAST_IN_HF, START, hf_folder
from tests.test_hf_qwen3 import config_of, tensors
from torchtitan_lite.checkpoint.hf_load import expected_shapes, pieces
from torchtitan_lite.checkpoint.reader import read_tensors
from torchtitan_lite.tools.hf_convert import export_to_hf, import_from_hf

# Layer n of a DeepSeek-V3 folder of n blocks whose MTP module is a mixture of `experts`, as DeepSeek-V3's
# model.safetensors.index.json names layer 61 (its fp8 scales aside).
def mtp_layer(experts: int) -> set[str]:
    return {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
            "shared_head.head.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
            *(f"self_attn.{p}.weight" for p in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                               "kv_a_layernorm", "kv_b_proj", "o_proj")),
            "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
            *(f"mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")),
            *(f"mlp.experts.{e}.{p}.weight" for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj"))}


def export(tmp_path, args, model=None):
    model = model if model is not None else ours(args)
    export_to_hf(save_run_checkpoint(model, tmp_path / "ckpt"), tmp_path / "hf", args, BOS, EOS, model="deepseek_v3")
    return model, tmp_path / "hf"


def test_the_debug_models_mtp_module_is_written_as_layer_2_with_deepseeks_names_and_the_copies(tmp_path):
    model, folder = export(tmp_path, BASE)
    config, written = config_of(folder), tensors(folder)
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (2, 1)
    assert {n.removeprefix("model.layers.2.") for n in written if n.startswith("model.layers.2.")} == mtp_layer(8)
    assert not any(n.startswith("model.layers.3.") for n in written)
    state = model.state_dict()
    for theirs, ours_ in {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                          "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "norm.weight",
                          "self_attn.kv_b_proj.weight": "attention.wkv_b.weight",
                          "mlp.gate.e_score_correction_bias": "moe.router.expert_bias"}.items():
        assert torch.equal(written[f"model.layers.2.{theirs}"], state[f"mtp.0.{ours_}"]), theirs
    assert torch.equal(written["model.layers.2.mlp.experts.5.up_proj.weight"], state["mtp.0.moe.experts.w3"][5])
    # the copies: the main model's tensors again, as DeepSeek's folders hold them
    assert torch.equal(written["model.layers.2.embed_tokens.weight"], written["model.embed_tokens.weight"])
    assert torch.equal(written["model.layers.2.shared_head.head.weight"], written["lm_head.weight"])


def test_671bs_mtp_module_is_layer_61_which_transformers_leaves_to_its_mtp_model():
    args = SPEC.args("671B", 129_280, 4096)
    hf = SPEC.hf.bound(args)
    names = [hf.hf_name(piece) for piece in pieces(hf, expected_shapes(SPEC, args))] + list(hf.copies)  # on meta
    layer = {n.removeprefix("model.layers.61.") for n in names if n.startswith("model.layers.61.")}
    assert layer == mtp_layer(256) and max(int(n.split(".")[2]) for n in names if n.startswith("model.layers.")) == 61
    ignored = re.compile("|".join(transformers.DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected))
    assert all(ignored.match(n) for n in names if n.startswith("model.layers.61."))  # loaded without a word
    config = SPEC.hf.config(args, 0, 1, torch.bfloat16)
    assert config["num_nextn_predict_layers"] == 1 and SPEC.hf.flavor_of(SPEC.hf.args_from_config(config)) == "671B"
    assert SPEC.hf.flavor_of(SPEC.hf.args_from_config({**config, "num_nextn_predict_layers": 0})) is None


@torch.no_grad()
def test_transformers_mtp_model_of_our_export_gives_our_mtp_logits(tmp_path):
    """transformers' MtpModel (what generate(use_mtp=True) drafts with) reads layer 2 of our export as DeepSeek's layer
    61, and its MTP layer, fed transformers' own main model's last hidden states (after its final norm, as generate
    feeds it) and the tokens one place ahead, gives our depth-1 logits: each tensor in its place, enorm and hnorm not
    swapped (swapped, the logits move far), the representation each depth takes as ours (models/common/mtp.py)."""
    model, folder = export(tmp_path, BASE)
    theirs = loaded(folder)
    # MtpModel finds the MTP layers by the main model's ignore patterns, which name DeepSeek-V3's layer 61 alone
    theirs._keys_to_ignore_on_load_unexpected = {r"model\.layers\.2\..*"}
    mtp = transformers.modeling_layers.MtpModel.from_pretrained(theirs).eval()
    t = tokens(65)
    inputs, ahead = t[:, :-1], t[:, 1:]
    bs, length = inputs.shape
    ours_mtp = model(inputs, mtp_tokens=ahead[..., None])[bs:]  # the main model's logits, then depth 1's
    last = {"h": theirs.model(inputs).last_hidden_state}  # after the final norm
    positions = torch.arange(length).expand(bs, length)

    def drafted():
        return mtp._project_to_logits(mtp.forward_layer(0, last["h"], positions, None, input_ids=ahead))
    diff = (drafted() - ours_mtp).abs().max().item()
    print(f"depth-1 logits max |ours - transformers' MtpModel|: {diff:.3g}")
    assert ours_mtp.abs().max() > 1 and diff <= TOLERANCE
    layer = mtp.layers[0]
    layer.enorm.weight, layer.hnorm.weight = layer.hnorm.weight, layer.enorm.weight
    moved = (drafted() - ours_mtp).abs().max().item()
    print(f"depth-1 logits max |enorm and hnorm swapped - not|: {moved:.3g}")
    assert moved > 100 * TOLERANCE


def test_a_folder_with_one_mtp_module_imports_as_mtp_depth_1_with_its_weights_and_not_its_copies(tmp_path):
    """num_nextn_predict_layers 1 gives mtp_depth 1, the debug flavor, and the module's tensors bit for bit. The
    copies are not read: zeroed in the folder, the import still holds the main embedding and head."""
    model, folder = export(tmp_path, BASE)
    weights = load_file(folder / "model.safetensors")
    for copy in ("model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"):
        weights[copy] = torch.zeros_like(weights[copy])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    args = import_from_hf(folder, tmp_path / "back", model="deepseek_v3")
    assert args.mtp_depth == 1 and SPEC.hf.flavor_of(args) == "debugmodel"
    back = read_tensors(str(tmp_path / "back"))
    state = model.state_dict()
    assert sum(name.startswith("model.mtp.0.") for name in back) == sum(name.startswith("mtp.0.") for name in state)
    for name, tensor in state.items():
        assert torch.equal(back[f"model.{name}"], tensor), name


def test_convert_from_hf_names_a_flavor_at_another_mtp_depth_with_its_setting(tmp_path, capsys):
    """A folder of the debug model's shape without its MTP module is no flavor's, but the debug flavor with
    model.mtp_depth 0: the config lines say so, rather than ask for a new flavor."""
    _, folder = export(tmp_path, BASE.with_(mtp_depth=0))
    capsys.readouterr()
    assert script("convert_from_hf").main([str(folder), str(tmp_path / "imported"), "--model", "deepseek_v3"]) == 0
    out = capsys.readouterr().out
    assert '[model]\nname = "deepseek_v3"\nflavor = "debugmodel"\nmtp_depth = 0\n' in out and "FLAVORS" not in out


def test_a_run_starts_from_a_folder_with_an_mtp_module_and_its_last_save_gives_it_back(tmp_path):
    """checkpoint.initial_load_in_hf reads the MTP module (and the selection biases) into the run's model, and
    checkpoint.last_save_in_hf writes it back with the copies: after a step that moves nothing (lr and bias step
    1e-30), the folder bit for bit. The folder is our export: transformers saves no MTP module."""
    args = SPEC.args("debugmodel", BYTES, tiny_model().max_seq_len)
    _, folder = export(tmp_path, args)
    run = train_in_process(tmp_path / "run", "--model.name", "deepseek_v3", "--model.flavor", "debugmodel", *START,
                           str(folder), *FROZEN, "--moe.load_balance_coeff", "1e-30", *LAST_IN_HF)
    n = len(expected_shapes(SPEC, args))  # every parameter and both selection biases
    assert f"loaded weights from {folder} (a Hugging Face folder: all {n} tensors of the model)" in run.stdout
    weights = load_file(folder / "model.safetensors")
    back = load_file(ckpt(tmp_path / "run", 1).with_name("step-1-hf") / "model.safetensors")
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)


@pytest.mark.parametrize("depth, overrides, expected", [
    (0, [], "mtp.0.attention_norm.weight is absent there, (256,) here: set model.mtp_depth 0"),
    (1, ["--model.mtp_depth", "0"], "mtp.0.attention_norm.weight is (256,) there, absent here: set model.mtp_depth 1"),
])
def test_check_refuses_a_folder_of_another_mtp_depth_in_one_line(error_line, tmp_path, depth, overrides, expected):
    _, folder = export(tmp_path, SPEC.args("debugmodel", BYTES, 64).with_(mtp_depth=depth))
    line = error_line(1, ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", *START, str(folder),
                          *overrides])
    assert line.startswith("error: checkpoint.initial_load_path: ") and expected in line, line


def test_check_refuses_a_folder_transformers_saved_without_the_mtp_module_its_config_counts(error_line, tmp_path,
                                                                                            capsys):
    """save_pretrained writes no MTP module but num_nextn_predict_layers 1, its default: the folder lacks the layer
    (docs/hf_interop.md: set it to 0 and model.mtp_depth 0)."""
    folder = hf_folder(tmp_path / "hf", flavor="debugmodel", model="deepseek_v3")
    capsys.readouterr()  # transformers' progress bars
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    line = error_line(1, ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", *START, str(folder)])
    assert "has no model.layers.2.input_layernorm.weight (" in line, line
