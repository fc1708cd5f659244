"""A mixture of experts exported to and imported from Mixtral's layout (models/llama3/hf.py), checked against
transformers' MixtralForCausalLM as tests/test_hf.py checks the dense model against its Llama: the same weights give
the same logits there and here, and every expert's every tensor is counted, so none can be dropped unnoticed."""

import json

import pytest
import torch
from safetensors import safe_open

from tests.multiprocess.launch import train_in_process
from tests.test_hf import BOS, BYTES, EOS, TOLERANCE, hf_model, load_ours, max_diff, ours, random_tokens, \
    randomize, save_run_checkpoint, script, transformers
from torchtitan_lite.config import load_config
from torchtitan_lite.models import registry
from torchtitan_lite.models.llama3.hf import model_args_from_hf
from torchtitan_lite.checkpoint.reader import read_tensors
from torchtitan_lite.models.llama3.model import ModelArgs, Transformer
from torchtitan_lite.models.common.moe import MoE, MoEArgs
from torchtitan_lite.models.spec import ConversionError
from torchtitan_lite.tools.hf_convert import export_to_hf, import_from_hf

# 4 experts of 48 (not the dense width), top 2, in both blocks; grouped queries.
MOE = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=BYTES, multiple_of=32,
                moe=MoEArgs(num_experts=4, top_k=2, hidden=48))


def tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - no __iter__


def test_export_gives_transformers_mixtral_our_logits_with_every_expert(tmp_path):
    model = ours(MOE)
    export_to_hf(save_run_checkpoint(model, tmp_path / "ckpt"), tmp_path / "hf", MOE, BOS, EOS)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["num_local_experts"], config["num_experts_per_tok"],
            config["intermediate_size"]) == (["MixtralForCausalLM"], 4, 2, 48)
    written = tensors(tmp_path / "hf")
    experts = [n for n in written if ".block_sparse_moe.experts." in n]
    assert len(experts) == 2 * 4 * 3  # layers x experts x (w1, w2, w3)
    assert len(written) == len(model.state_dict()) - 2 * 3 + len(experts)  # each 3-D weight as its 4 experts
    for name, w in model.state_dict().items():
        if ".moe.experts." in name:  # expert e's slice, as an nn.Linear weight of its own
            i, part = name.split(".")[1], name.rsplit(".", 1)[1]
            for e in range(4):
                assert torch.equal(written[f"model.layers.{i}.block_sparse_moe.experts.{e}.{part}.weight"], w[e])
    theirs = hf_model(tmp_path / "hf")
    assert type(theirs).__name__ == "MixtralForCausalLM"
    diff = max_diff(model, theirs, random_tokens(48))
    print(f"logits max |ours - transformers' Mixtral|: {diff:.3g}")
    assert diff <= TOLERANCE


def test_import_gives_us_mixtrals_logits_and_exports_back_bit_for_bit(tmp_path):
    config = transformers.MixtralConfig(vocab_size=BYTES, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, rope_theta=5000.0, rms_norm_eps=1e-5,
                                        max_position_embeddings=64, tie_word_embeddings=False)
    reference = randomize(transformers.MixtralForCausalLM(config)).eval()
    reference.save_pretrained(tmp_path / "hf")
    args = import_from_hf(tmp_path / "hf", tmp_path / "ckpt")
    # The auxiliary loss at the folder's router_aux_loss_coef, although output_router_logits is off there.
    assert not config.output_router_logits
    assert args.moe == MoEArgs(num_experts=4, top_k=2, hidden=48, aux_loss_coeff=config.router_aux_loss_coef)
    assert model_args_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text())) == args
    diff = max_diff(load_ours(tmp_path / "ckpt", args), reference, random_tokens(48))
    print(f"logits max |ours - transformers' Mixtral|, import: {diff:.3g}")
    assert diff <= TOLERANCE
    export_to_hf(tmp_path / "ckpt", tmp_path / "back", args, BOS, EOS)
    saved, back = tensors(tmp_path / "hf"), tensors(tmp_path / "back")
    assert saved.keys() == back.keys() and len(back) == 3 + 2 * (7 + 4 * 3)  # top; per layer: attention, norms, gate, experts
    assert all(torch.equal(saved[k], back[k]) for k in saved)


def test_an_export_leaves_transformers_loss_the_language_models_whatever_the_auxiliary_loss(tmp_path):
    """output_router_logits on would make transformers add the auxiliary loss to `outputs.loss`, which evaluations
    read as the language model's: the export keeps it off and the coefficient in router_aux_loss_coef, which an
    import reads back either way."""
    args = MOE.with_(moe=MoEArgs(num_experts=4, top_k=2, hidden=48, aux_loss_coeff=0.5))
    export_to_hf(save_run_checkpoint(ours(args), tmp_path / "ckpt"), tmp_path / "hf", args, BOS, EOS)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["output_router_logits"], config["router_aux_loss_coef"]) == (False, 0.5)
    tokens = random_tokens(32)
    with torch.no_grad():
        out = hf_model(tmp_path / "hf")(tokens, labels=tokens)
    plain = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    print(f"transformers' loss {out.loss.item():.6f}, cross-entropy of its logits {plain.item():.6f}")
    assert out.loss.item() == pytest.approx(plain.item(), abs=1e-6)
    for routed in (False, True):
        assert model_args_from_hf({**config, "output_router_logits": routed}).moe.aux_loss_coeff == 0.5


@pytest.mark.parametrize("change, said", [
    ({"shared_experts": 1}, "moe.shared_experts = 1"), ({"score_func": "sigmoid"}, "moe.score_func = sigmoid"),
    ({"renormalize": False}, "moe.renormalize = False"), ({"route_scale": 2.5}, "moe.route_scale = 2.5"),
    ({"every": 2}, "moe.every = 2"), ({"load_balance_coeff": 1e-3}, "moe.load_balance_coeff = 0.001"),
])
def test_what_mixtrals_routing_cannot_hold_is_refused_before_a_file_is_written(tmp_path, change, said):
    args = MOE.with_(moe=MoEArgs(num_experts=4, top_k=2, hidden=48, **change))
    ckpt = save_run_checkpoint(ours(args), tmp_path / "ckpt")
    with pytest.raises(ConversionError, match=f"Mixtral's layout cannot hold {said}"):
        export_to_hf(ckpt, tmp_path / "hf", args, BOS, EOS)
    assert not (tmp_path / "hf").exists()


def test_the_scripts_take_a_trained_moe_checkpoint_as_a_dense_one(tmp_path, capsys):
    """scripts/convert_to_hf.py writes the run's Mixtral folder (with its tokenizer), which transformers computes as
    we do; scripts/generate.py continues a prompt from the same checkpoint."""
    train_in_process(tmp_path / "run", "--model.flavor", "tiny_moe", "--training.steps", "1", "--checkpoint.enable")
    assert script("convert_to_hf").main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    cfg = load_config(["--job.config_file", str(tmp_path / "run" / "config.toml")])
    args = registry.get("llama3").run_args(cfg, json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"])
    trained = Transformer(args).eval()
    trained.load_state_dict({k.removeprefix("model."): v for k, v in read_tensors(str(tmp_path / "run" / "checkpoint"
                                                                                     / "step-1")).items()
                             if k.startswith("model.")})
    diff = max_diff(trained, hf_model(tmp_path / "hf"), random_tokens(32) % args.vocab_size)
    print(f"logits max |ours - transformers' Mixtral|, trained tiny_moe: {diff:.3g}")
    assert diff <= TOLERANCE
    capsys.readouterr()
    assert script("generate").main(["--checkpoint", str(tmp_path / "run"), "--prompt", "def", "--temperature", "0",
                                    "--max_new_tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("def")


def test_the_auxiliary_loss_is_transformers_mixtrals_for_one_sequence_and_layer():
    """moe.aux_loss_coeff's loss (models/moe.balance_loss) is transformers' load_balancing_loss_func where the two
    agree on what they average over: one sequence, one layer (ours is a mean over sequences and layers)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: PLC0415

    layer = randomize(MoE(64, 48, MoEArgs(num_experts=4, top_k=2, aux_loss_coeff=1.0)))
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(3))
    layer(x)
    theirs = load_balancing_loss_func((layer.router.gate(x.view(40, 64)),), 4, 2)
    ours = layer.aux_sum.item()  # summed over the forwards since the load was read: this one's
    print(f"auxiliary loss: ours {ours:.6f}, transformers' {theirs.item():.6f}")
    assert abs(ours - theirs.item()) <= 1e-6 * theirs.item() and theirs.item() > 1.5  # k = 2 at balance
