"""DeepSeek-V3 exported to and imported from Hugging Face folders (models/deepseek_v3/hf.py through
tools/hf_convert.py), checked against transformers' DeepseekV3ForCausalLM (eager attention, fp32) as
tests/test_hf_qwen3.py checks Qwen3: the same weights give the same logits and greedy text there and here, every
tensor is counted both ways, the selection bias travels as e_score_correction_bias, and a round trip gives back the
same bits, the debug model's multi-token prediction (MTP) module included (tests/test_hf_deepseek_v3_mtp.py checks its
layout and its logits against transformers').

Our models start from init_weights with the norms' weights and the selection bias then drawn at random: norms at 1,
or a bias at 0, would hide a misplaced one. Each case's special feature is shown to move the logits far beyond the
tolerance, so passing proves it is carried, not merely present.
"""

import dataclasses
import json
import re

import pytest
import torch

from safetensors.torch import load_file, save_file

from tests.multiprocess.launch import TINY, ckpt, train_in_process
from tests.test_hf import BOS, EOS, TOLERANCE, assert_same_tensors, max_diff, one_error_line, randomize, \
    save_run_checkpoint, script, transformers
from tests.test_hf_load import FROZEN, LAST_IN_HF, START, hf_folder
from tests.test_hf_qwen3 import assert_theirs_is_ours, config_of, load_ours, tensors
from tests.test_hf_qwen3 import ours as qwen3_ours
from torchtitan_lite.checkpoint.reader import read_tensors
from torchtitan_lite.config import load_config, to_toml
from torchtitan_lite.data.hf_tokenizer import run_tokenizer
from torchtitan_lite.models import registry
from torchtitan_lite.models.common.decoder import Decoder
from torchtitan_lite.models.common.rope import YaRN
from torchtitan_lite.models.spec import ConversionError
from torchtitan_lite.tools.hf_convert import export_to_hf, import_from_hf

SPEC = registry.get("deepseek_v3")
VOCAB = 512
BASE = SPEC.args("debugmodel", VOCAB, 64)  # a query latent, 8 experts in 4 groups (top 2 of the best 2), 1 shared
CASES = {
    "query_latent": BASE,
    "no_query_latent": BASE.with_(q_rank=0),
    "yarn": BASE.with_(yarn=YaRN(original_seq_len=32)),  # applies at 64 positions: factor 40, softmax scale too
    "yarn_no_mscale": BASE.with_(yarn=YaRN(original_seq_len=32, mscale=0.0)),  # the frequencies alone
    # trained without load balancing: no bias of ours, zeros in the folder
    "no_bias": BASE.with_(moe=dataclasses.replace(BASE.moe, load_balance_coeff=0.0)),
}


def tokens(length=48, seed=0):
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def ours(args, seed=0):
    """test_hf_qwen3's model (norm weights away from 1), with a selection bias of the order of the sigmoid scores'
    spread: it moves routes."""
    model = qwen3_ours(args, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


def is_mtp(name: str, n_layers: int) -> bool:
    """Whether their tensor `name` is an MTP module's: of a layer after the model's n_layers."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m[1]) >= n_layers


def loaded(folder):
    """transformers' model of the folder, in eager attention. DeepseekV3ForCausalLM has no place for the MTP modules'
    layers (its MtpModel, generate's use_mtp, reads them apart): they are all it may find unexpected, which its load
    report lists unless the layer is 61, DeepSeek-V3's, the one it ignores by name."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not (info["missing_keys"] or info["mismatched_keys"] or info["error_msgs"]), info
    assert all(is_mtp(name, model.config.num_hidden_layers) for name in info["unexpected_keys"]), info
    return model.eval()


@torch.no_grad()
def imported(args):
    """What an import of `args` exported gives: the same model, YaRN where it applies, load balancing on (the
    folder's bias is held as our selection bias)."""
    yarn = args.yarn if args.yarn is not None and args.yarn.applies(args.max_seq_len) else None
    return args.with_(yarn=yarn, moe=dataclasses.replace(args.moe, load_balance_coeff=1e-3))


@pytest.mark.parametrize("case", CASES)
def test_export_gives_transformers_our_logits_and_greedy_text_and_imports_back_bit_for_bit(tmp_path, case):
    args = CASES[case]
    model = ours(args)
    export_to_hf(save_run_checkpoint(model, tmp_path / "ckpt"), tmp_path / "hf", args, BOS, EOS, model="deepseek_v3")
    config, written = config_of(tmp_path / "hf"), tensors(tmp_path / "hf")
    assert (config["architectures"], config["q_lora_rank"], config["n_group"], config["topk_group"],
            config["first_k_dense_replace"], config["routed_scaling_factor"]) == (
        ["DeepseekV3ForCausalLM"], args.q_rank or None, 4, 2, 1, 2.5)
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    assert config["rope_scaling"] == {  # mscale 0 says transformers' default factor of cos and sin is not applied
        "yarn": yarn, "yarn_no_mscale": {**yarn, "mscale": 0.0, "mscale_all_dim": 0.0, "attention_factor": 1.0}
    }.get(case)
    # two mixture blocks (block 1 and the MTP module's) x experts x (gate, up, down)
    assert sum(".mlp.experts." in n for n in written) == 2 * 8 * 3
    state = model.state_dict()
    assert all(torch.equal(written[f"model.layers.1.mlp.experts.{e}.down_proj.weight"],
                           state["layers.1.moe.experts.w2"][e]) for e in range(8))
    bias = written["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(bias, state.get("layers.1.moe.router.expert_bias", torch.zeros(8)))
    theirs = loaded(tmp_path / "hf")
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    assert torch.equal(theirs.model.layers[1].mlp.gate.e_score_correction_bias, bias)
    diff = max_diff(model, theirs, tokens(64))
    print(f"logits max |ours - transformers' DeepseekV3|, {case}: {diff:.3g}")
    assert diff <= TOLERANCE
    # The feature is carried: without it the logits move far beyond the tolerance.
    if case in ("query_latent", "yarn", "yarn_no_mscale"):
        other = Decoder(args.with_(yarn=None) if case.startswith("yarn") else args).eval()
        other.load_state_dict(state)
        if case == "query_latent":  # the selection bias
            other.layers["1"].moe.router.expert_bias.zero_()
        moved = max_diff(model, other, tokens(64))
        print(f"logits max |with - without the {'selection bias' if case == 'query_latent' else 'YaRN'}|: {moved:.3g}")
        assert moved > 100 * TOLERANCE
    main = {name: w for name, w in written.items() if not is_mtp(name, args.n_layers)}  # what transformers holds
    assert_theirs_is_ours(model, theirs, main, tmp_path / "resaved", [BOS, *tokens(8, seed=1)[0].tolist()])
    back = import_from_hf(tmp_path / "hf", tmp_path / "back", model="deepseek_v3")
    assert back == imported(args)
    expected = {f"model.{k}": v for k, v in state.items()}
    if case == "no_bias":  # ours now holds the folder's zeros
        expected["model.layers.1.moe.router.expert_bias"] = expected["model.mtp.0.moe.router.expert_bias"] = \
            torch.zeros(8)
    assert_same_tensors(read_tensors(str(tmp_path / "back")), expected)


def test_a_dense_model_exports_as_every_block_before_first_k_dense_replace(tmp_path):
    args = BASE.with_(moe=None)
    model = ours(args)
    export_to_hf(save_run_checkpoint(model, tmp_path / "ckpt"), tmp_path / "hf", args, BOS, EOS, model="deepseek_v3")
    # the MTP module's layer (2) dense too, by its index, as its tensors are
    assert config_of(tmp_path / "hf")["first_k_dense_replace"] == args.n_layers + 1
    assert "model.layers.2.mlp.gate_proj.weight" in tensors(tmp_path / "hf")
    theirs = loaded(tmp_path / "hf")
    assert not any(".mlp.experts." in name or ".mlp.gate." in name for name in theirs.state_dict())
    diff = max_diff(model, theirs, tokens(64))
    print(f"logits max |ours - transformers' DeepseekV3|, dense: {diff:.3g}")
    assert diff <= TOLERANCE
    assert import_from_hf(tmp_path / "hf", tmp_path / "back", model="deepseek_v3") == args.with_(yarn=None)


SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48,
         "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24,
         "n_routed_experts": 8, "num_experts_per_tok": 3, "n_shared_experts": 2, "n_group": 4, "topk_group": 2,
         "first_k_dense_replace": 1, "routed_scaling_factor": 1.5, "max_position_embeddings": 64,
         "tie_word_embeddings": False, "num_nextn_predict_layers": 0}
MADE = {  # transformers' 5 form, rope_parameters, with the theta inside
    "query_latent_yarn": {**SMALL, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}},
    "no_query_latent": {**SMALL, "q_lora_rank": None, "norm_topk_prob": False, "n_group": 1, "topk_group": 1,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
}


def made_by_transformers(path, case):
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**MADE[case], attn_implementation="eager"))
    randomize(model)
    gen = torch.Generator().manual_seed(1)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.3)
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("case", MADE)
def test_a_folder_transformers_saved_imports_with_its_logits_and_exports_back_bit_for_bit(tmp_path, case):
    reference = made_by_transformers(tmp_path / "hf", case)
    args = import_from_hf(tmp_path / "hf", tmp_path / "ckpt", model="deepseek_v3")
    assert (args.q_rank, args.v_dim, args.rope_theta, args.moe.shared_experts, args.moe.route_scale,
            args.moe.load_balance_coeff) == (48 if case == "query_latent_yarn" else 0, 24, 5000.0, 2, 1.5, 1e-3)
    assert args.yarn == (YaRN(factor=4.0, original_seq_len=32, mscale=0.707) if case == "query_latent_yarn" else None)
    ckpt_tensors = read_tensors(str(tmp_path / "ckpt"))
    assert torch.equal(ckpt_tensors["model.layers.2.moe.router.expert_bias"],
                       reference.model.layers[2].mlp.gate.e_score_correction_bias)
    diff = max_diff(load_ours(tmp_path / "ckpt", args), reference, tokens(64))
    print(f"logits max |ours - transformers' DeepseekV3|, import {case}: {diff:.3g}")
    assert diff <= TOLERANCE
    export_to_hf(tmp_path / "ckpt", tmp_path / "back", args, BOS, EOS, model="deepseek_v3")
    saved, back = tensors(tmp_path / "hf"), tensors(tmp_path / "back")
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)


def _tied(args):
    args = args.with_()
    object.__setattr__(args, "tie_embeddings", True)  # a class attribute of ours: no DeepSeek-V3 ties them
    return args


@pytest.mark.parametrize("args, said", [
    # torchtitan's 16B's routing (DeepSeek-V2-Lite's), at the debug model's size
    (BASE.with_(moe=dataclasses.replace(SPEC.flavors["16B"].moe, num_experts=8, top_k=2, hidden=128)),
     "moe.score_func = softmax"),
    (BASE.with_(moe=dataclasses.replace(BASE.moe, every=2)), "moe.every = 2"),
    (BASE.with_(moe=dataclasses.replace(BASE.moe, shared_experts=0)), "moe.shared_experts = 0"),
    (BASE.with_(moe=dataclasses.replace(BASE.moe, n_group=8)), "moe.n_group = 8 of one expert each"),
    (BASE.with_(norm_eps=1e-5), "norm_eps = 1e-05"),
    (_tied(BASE), "tied embeddings"),
])
def test_what_deepseek_v3s_layout_cannot_hold_is_refused_in_one_line_before_a_file_is_written(tmp_path, args, said):
    with pytest.raises(ConversionError, match=f"DeepSeek-V3's layout cannot hold {said}") as e:
        export_to_hf(save_run_checkpoint(ours(args), tmp_path / "ckpt"), tmp_path / "hf", args, BOS, EOS,
                     model="deepseek_v3")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("change, expected", [
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}, "DeepseekV2ForCausalLM"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq 2"),
    ({"rope_interleave": False}, "rope_interleave = false"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps = 1e-05"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings = true"),
    ({"n_shared_experts": 0}, "n_shared_experts 0"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "mscale": 1.0,
                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}}, "within its original 64"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "mscale": 1.0,
                          "original_max_position_embeddings": 32}}, "mscale 1.0, mscale_all_dim 0.0"),
])
def test_import_refuses_what_our_model_cannot_represent(tmp_path, capsys, change, expected):
    made_by_transformers(tmp_path / "hf", "no_query_latent")
    capsys.readouterr()  # transformers' progress bars
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config_of(tmp_path / "hf"), **change}))
    assert script("convert_from_hf").main([str(tmp_path / "hf"), str(tmp_path / "out"), "--model",
                                           "deepseek_v3"]) == 2
    one_error_line(capsys, expected)
    assert list(tmp_path.iterdir()) == [tmp_path / "hf"]  # nothing half-written


def test_the_scripts_convert_a_deepseek_v3_run_both_ways(tmp_path, capsys):
    """convert_to_hf.py on a run of model.name deepseek_v3 (the model from its config.toml), then convert_from_hf.py
    --model deepseek_v3, which names the run's flavor and gives back the run's tensors, selection bias included."""
    cfg = load_config(["--job.config_file", str(TINY), "--model.name", "deepseek_v3", "--model.flavor", "debugmodel"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text(to_toml(cfg))
    model = ours(SPEC.run_args(cfg, run_tokenizer(cfg).n_words))
    save_run_checkpoint(model, ckpt(tmp_path / "run", 3))
    assert script("convert_to_hf").main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert config_of(tmp_path / "hf")["model_type"] == "deepseek_v3"
    capsys.readouterr()
    assert script("convert_from_hf").main([str(tmp_path / "hf"), str(tmp_path / "imported"), "--model",
                                           "deepseek_v3"]) == 0
    out = capsys.readouterr().out
    assert 'name = "deepseek_v3"' in out and 'flavor = "debugmodel"' in out
    original = {f"model.{k}": v for k, v in model.state_dict().items()}
    assert_same_tensors(read_tensors(str(tmp_path / "imported")), original)


def test_a_run_starts_from_a_deepseek_v3_folder_selection_bias_included_and_its_last_save_gives_it_back(tmp_path):
    """checkpoint.initial_load_in_hf reads the folder's e_score_correction_bias into our selection bias (the folder's
    model routes by it), and checkpoint.last_save_in_hf writes it back: after a step that moves nothing (lr 1e-30,
    and a bias step of 1e-30, far below half an ulp of the bias), the folder's tensors bit for bit. transformers
    saves no MTP module, though its config.json says num_nextn_predict_layers 1 (its default): with it set to 0, as
    docs/hf_interop.md says, the folder starts a run of model.mtp_depth 0."""
    folder = hf_folder(tmp_path / "hf", flavor="debugmodel", model="deepseek_v3")
    (folder / "config.json").write_text(json.dumps({**config_of(folder), "num_nextn_predict_layers": 0}))
    weights = load_file(folder / "model.safetensors")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    weights[bias] = torch.randn(8, generator=torch.Generator().manual_seed(0)) * 0.1
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    run = train_in_process(tmp_path / "run", "--model.name", "deepseek_v3", "--model.flavor", "debugmodel", *START,
                           str(folder), *FROZEN, "--moe.load_balance_coeff", "1e-30", "--model.mtp_depth", "0",
                           *LAST_IN_HF)
    assert f"loaded weights from {folder} (a Hugging Face folder: all 32 tensors of the model)" in run.stdout
    back = load_file(ckpt(tmp_path / "run", 1).with_name("step-1-hf") / "model.safetensors")
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)


def test_a_bf16_export_keeps_the_selection_bias_in_fp32(tmp_path):
    """Exported in bf16, the weights are bf16 and the selection bias stays fp32, bit for bit, as DeepSeek publishes it
    and transformers keeps it: the bias moves in steps of 1e-3, which bf16 would round into other routes."""
    model = ours(BASE)
    export_to_hf(save_run_checkpoint(model, tmp_path / "ckpt"), tmp_path / "hf", BASE, BOS, EOS,
                 dtype=torch.bfloat16, model="deepseek_v3")
    written = tensors(tmp_path / "hf")
    bias = written["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, model.layers["1"].moe.router.expert_bias)
    assert written["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert written["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
