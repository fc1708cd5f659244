"""Qwen3 exported to and imported from Hugging Face folders (models/qwen3/hf.py through tools/hf_convert.py), checked
against transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM as tests/test_hf.py checks Llama: the same weights
give the same logits and greedy text there and here, every tensor is counted both ways (what transformers saves
itself, no key missing or unexpected when it loads ours), and a round trip gives back the same bits.

Our models start from init_weights with the norms' weights then drawn at random: they start at 1, where a misplaced
norm, or QK-norm's weight left in RoPE's pair order, would change nothing.
"""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from tests.multiprocess.launch import TINY, ckpt
from tests.test_hf import BOS, BYTES, EOS, TOLERANCE, assert_same_tensors, max_diff, one_error_line, random_tokens, \
    randomize, save_run_checkpoint, script, transformers
from torchtitan_lite.checkpoint.reader import read_tensors
from torchtitan_lite.config import load_config, to_toml
from torchtitan_lite.data.hf_tokenizer import run_tokenizer
from torchtitan_lite.models import registry
from torchtitan_lite.models.common.decoder import Decoder
from torchtitan_lite.models.spec import ConversionError
from torchtitan_lite.tools.generation import generate
from torchtitan_lite.tools.hf_convert import export_to_hf, import_from_hf

SPEC = registry.get("qwen3")
TIED = SPEC.args("debugmodel", BYTES, 64)  # head_dim 64 with dim 256 and 8 heads: not dim / heads
CASES = {"tied": TIED, "untied": dataclasses.replace(TIED, tie_embeddings=False),
         "moe": SPEC.args("debugmodel_moe", BYTES, 64)}  # 16 experts of 128, top 4, renormalized


@torch.no_grad()
def ours(args, seed=0):
    model = Decoder(args)
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 1:  # RMSNorm and QK-norm weights
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    return model.eval()


def load_ours(dcp_folder, args):
    model = Decoder(args).eval()
    model.load_state_dict({k.removeprefix("model."): v for k, v in read_tensors(str(dcp_folder)).items()})
    return model


def tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - no __iter__


def loaded(folder, **options):
    """transformers' model of the folder (fp32; `options` as from_pretrained's), which must hold exactly the tensors
    it expects."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                     output_loading_info=True, **options)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys, no errors
    return model.eval()


def assert_theirs_is_ours(model, theirs, written: dict, resaved, prompt: list[int]) -> None:
    """Every tensor counted: transformers' model `theirs`, loaded from our export `written`, saves exactly it, with
    the same bits; and its greedy text of `prompt` is ours (tools/generation.py, through our KV cache)."""
    theirs.save_pretrained(resaved)
    again = tensors(resaved)
    assert again.keys() == written.keys() and all(torch.equal(again[k], written[k]) for k in written)
    theirs.generation_config.eos_token_id = None  # the full length: ours is asked for no EOS either
    with torch.no_grad():
        out = theirs.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert generate(model, prompt, 16) == out[0, len(prompt):].tolist()


def config_of(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_export_gives_transformers_our_logits_and_greedy_text_and_imports_back_bit_for_bit(tmp_path, case):
    args = CASES[case]
    model = ours(args)
    export_to_hf(save_run_checkpoint(model, tmp_path / "ckpt"), tmp_path / "hf", args, BOS, EOS, model="qwen3")
    config, written = config_of(tmp_path / "hf"), tensors(tmp_path / "hf")
    assert (config["head_dim"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (64, 4, case == "tied")
    assert ("lm_head.weight" in written) == (case != "tied")  # a tied table once, as the published small sizes
    if case == "moe":
        assert (config["architectures"], config["num_experts"], config["num_experts_per_tok"],
                config["moe_intermediate_size"], config["norm_topk_prob"], config["output_router_logits"]) == (
            ["Qwen3MoeForCausalLM"], 16, 4, 128, True, False)
        assert sum(".mlp.experts." in n for n in written) == 2 * 16 * 3  # layers x experts x (gate, up, down)
        w1 = model.state_dict()["layers.1.moe.experts.w1"]
        assert all(torch.equal(written[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"], w1[e]) for e in range(16))
    theirs = loaded(tmp_path / "hf")
    assert type(theirs).__name__ == ("Qwen3MoeForCausalLM" if case == "moe" else "Qwen3ForCausalLM")
    diff = max_diff(model, theirs, random_tokens(48))
    print(f"logits max |ours - transformers' Qwen3|, {case}: {diff:.3g}")
    assert diff <= TOLERANCE
    assert_theirs_is_ours(model, theirs, written, tmp_path / "resaved", [BOS, *random_tokens(8, seed=1)[0].tolist()])
    assert import_from_hf(tmp_path / "hf", tmp_path / "back", model="qwen3") == args
    assert_same_tensors(read_tensors(str(tmp_path / "back")), {f"model.{k}": v for k, v in model.state_dict().items()})


def test_an_export_leaves_transformers_loss_the_language_models_whatever_the_auxiliary_loss(tmp_path):
    """output_router_logits on would make transformers add the auxiliary loss to `outputs.loss`, which evaluations
    read as the language model's: the export keeps it off and the coefficient in router_aux_loss_coef."""
    args = CASES["moe"].with_(moe=dataclasses.replace(CASES["moe"].moe, aux_loss_coeff=0.5))
    export_to_hf(save_run_checkpoint(ours(args), tmp_path / "ckpt"), tmp_path / "hf", args, BOS, EOS, model="qwen3")
    config = config_of(tmp_path / "hf")
    assert (config["output_router_logits"], config["router_aux_loss_coef"]) == (False, 0.5)
    tokens = random_tokens(32)
    with torch.no_grad():
        out = loaded(tmp_path / "hf")(tokens, labels=tokens)
    plain = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    print(f"transformers' loss {out.loss.item():.6f}, cross-entropy of its logits {plain.item():.6f}")
    assert out.loss.item() == pytest.approx(plain.item(), abs=1e-6)


SMALL = {"vocab_size": BYTES, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rope_theta": 5000.0,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 64}
MOE = {**SMALL, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
MADE = {  # transformers' defaults where not said: norm_topk_prob off (unnormalized top-k weights)
    "tied": ("Qwen3", {**SMALL, "tie_word_embeddings": True}),
    "untied": ("Qwen3", SMALL),
    "moe": ("Qwen3Moe", MOE),
    # blocks 0 and 1 dense (mlp_only_layers), then every 2nd a mixture: only block 3
    "moe_dense_blocks": ("Qwen3Moe", {**MOE, "num_hidden_layers": 4, "mlp_only_layers": [0, 1],
                                      "decoder_sparse_step": 2, "norm_topk_prob": True}),
}


def made_by_transformers(path, case):
    kind, settings = MADE[case]
    model = getattr(transformers, f"{kind}ForCausalLM")(getattr(transformers, f"{kind}Config")(**settings))
    randomize(model).save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("case", MADE)
def test_a_folder_transformers_saved_imports_with_its_logits_and_exports_back_bit_for_bit(tmp_path, case):
    reference = made_by_transformers(tmp_path / "hf", case)
    args = import_from_hf(tmp_path / "hf", tmp_path / "ckpt", model="qwen3")
    assert (args.head_dim, args.rope_theta, args.tie_embeddings) == (32, 5000.0, case == "tied")
    if args.moe:
        assert (args.moe.renormalize, args.moe.every, args.moe.first_dense) == (
            (True, 2, 2) if case == "moe_dense_blocks" else (False, 1, 0))
    diff = max_diff(load_ours(tmp_path / "ckpt", args), reference, random_tokens(48))
    print(f"logits max |ours - transformers' Qwen3|, import {case}: {diff:.3g}")
    assert diff <= TOLERANCE
    export_to_hf(tmp_path / "ckpt", tmp_path / "back", args, BOS, EOS, model="qwen3")
    saved, back = tensors(tmp_path / "hf"), tensors(tmp_path / "back")
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)


@pytest.mark.parametrize("case, change, expected", [
    ("untied", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "LlamaForCausalLM"),
    ("untied", {"attention_bias": True}, "attention_bias"),
    ("untied", {"hidden_act": "gelu"}, "hidden_act"),
    ("untied", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0}}, "yarn"),
    ("untied", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1, "layer_types": None},
     "a sliding window of 16 in blocks [1]"),
    ("moe", {"use_sliding_window": True, "sliding_window": 16}, "a sliding window of 16 in blocks [0, 1]"),
    ("moe", {"mlp_only_layers": [1]}, "mlp_only_layers [1]"),
])
def test_import_refuses_what_our_model_cannot_represent(tmp_path, capsys, case, change, expected):
    made_by_transformers(tmp_path / "hf", case)
    capsys.readouterr()  # transformers' progress bars
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config_of(tmp_path / "hf"), **change}))
    assert script("convert_from_hf").main([str(tmp_path / "hf"), str(tmp_path / "out"), "--model", "qwen3"]) == 2
    one_error_line(capsys, expected)
    assert list(tmp_path.iterdir()) == [tmp_path / "hf"]  # nothing half-written


@pytest.mark.parametrize("change, said", [
    ({"shared_experts": 1}, "moe.shared_experts = 1"), ({"score_func": "sigmoid"}, "moe.score_func = sigmoid"),
    ({"route_scale": 2.5}, "moe.route_scale = 2.5"), ({"load_balance_coeff": 1e-3}, "moe.load_balance_coeff = 0.001"),
])
def test_what_qwen3_moes_routing_cannot_hold_is_refused_before_a_file_is_written(tmp_path, change, said):
    args = CASES["moe"].with_(moe=dataclasses.replace(CASES["moe"].moe, **change))
    ckpt_path = save_run_checkpoint(ours(args), tmp_path / "ckpt")
    with pytest.raises(ConversionError, match=f"Qwen3-MoE's layout cannot hold {said}"):
        export_to_hf(ckpt_path, tmp_path / "hf", args, BOS, EOS, model="qwen3")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_the_scripts_convert_a_qwen3_run_both_ways(tmp_path, capsys, flavor):
    """convert_to_hf.py on a run of model.name qwen3 (the model from its config.toml), then convert_from_hf.py
    --model qwen3, which names the run's flavor and gives back the run's tensors."""
    cfg = load_config(["--job.config_file", str(TINY), "--model.name", "qwen3", "--model.flavor", flavor])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text(to_toml(cfg))
    model = ours(SPEC.run_args(cfg, run_tokenizer(cfg).n_words))
    save_run_checkpoint(model, ckpt(tmp_path / "run", 3))
    assert script("convert_to_hf").main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert config_of(tmp_path / "hf")["model_type"] == ("qwen3_moe" if flavor.endswith("moe") else "qwen3")
    capsys.readouterr()
    assert script("convert_from_hf").main([str(tmp_path / "hf"), str(tmp_path / "imported"), "--model", "qwen3"]) == 0
    out = capsys.readouterr().out
    assert 'name = "qwen3"' in out and f'flavor = "{flavor}"' in out
    original = {f"model.{k}": v for k, v in model.state_dict().items()}
    assert_same_tensors(read_tensors(str(tmp_path / "imported")), original)
