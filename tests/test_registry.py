"""model.name and model.flavor choose from the registry and the chosen spec, never from a second list, and a layout a
spec cannot take is refused at preflight (tests/multiprocess/test_model_spec.py trains a second, registered model)."""

import pytest
import torch

from torchtitan_lite.models import registry
from torchtitan_lite.models.llama3 import spec as llama3
from torchtitan_lite.models.spec import ModelSpec


def test_an_unknown_model_or_flavor_is_one_line_with_the_choices(error_line, monkeypatch):
    assert error_line(1, ["--model.name", "lama3"]) == (
        "error: model.name 'lama3' is not a registered model: choose one of llama3, qwen3, deepseek_v3; did you mean "
        "llama3?")
    assert error_line(1, ["--model.flavor", "debugmodle"]) == (
        "error: model.flavor 'debugmodle' is not a flavor of model llama3: choose one of tiny, debugmodel, 8B, 70B, "
        "405B, debugmodel_moe, tiny_moe, mixtral_8x7b, mixtral_8x22b; did you mean debugmodel or debugmodel_moe?")
    toy = ModelSpec("toy", llama3.SPEC.model_class, {"small": llama3.SPEC.flavors["tiny"]}, llama3.SPEC.tp_plan,
                    llama3.SPEC.tp_sizes, llama3.SPEC.flops_per_token)
    monkeypatch.setitem(registry.SPECS, "toy", toy)  # the choices are the registry's, whoever registered them
    assert "choose one of llama3, qwen3, deepseek_v3, toy" in error_line(1, ["--model.name", "tyo"])
    assert "not a flavor of model toy: choose one of small" in error_line(1, ["--model.name", "toy"])
    # A spec that takes no settings refuses the [moe] keys rather than train a model other than the one asked for.
    assert error_line(1, ["--model.name", "toy", "--model.flavor", "small", "--moe.top_k", "2"]) == (
        "error: moe.top_k is set but model toy takes no [moe] settings: remove it")


def test_a_name_is_registered_once():
    assert registry.register(llama3.SPEC) is llama3.SPEC  # the same spec again: nothing changes
    with pytest.raises(ValueError, match="'llama3' is already registered"):
        registry.register(ModelSpec("llama3", torch.nn.Linear, {}, dict, dict, len))


def test_context_parallelism_needs_the_models_swappable_attention(error_line, monkeypatch):
    plain = ModelSpec("plain", torch.nn.Module, llama3.SPEC.flavors, llama3.SPEC.tp_plan, llama3.SPEC.tp_sizes,
                      llama3.SPEC.flops_per_token)  # a model class without attend_with
    monkeypatch.setitem(registry.SPECS, "plain", plain)
    assert "model plain has no swappable attention (attend_with)" in error_line(
        2, ["--model.name", "plain", "--parallelism.context_parallel_degree", "2"])


@pytest.mark.parametrize("model, flavor", [("llama3", "tiny"), ("llama3", "tiny_moe"), ("qwen3", "debugmodel"),
                                           ("qwen3", "debugmodel_moe")])
def test_the_spec_says_which_parameters_are_matrices_embeddings_and_norms(model, flavor):
    """An optimizer's parameter groups come from the spec (Muon: the matrices): every parameter has one, matrices are
    at least 2-D (3-D for routed experts), norms 1-D (QK-norm's among them), the table and output are embeddings."""
    spec = registry.get(model)
    with torch.device("meta"):
        named = dict(spec.model_class(spec.args(flavor, 64, 16)).named_parameters())
    groups = {name: spec.param_group(name) for name in named}
    assert all(named[n].dim() >= 2 for n, g in groups.items() if g in ("matrix", "embedding", "router"))
    assert all(named[n].dim() == 1 for n, g in groups.items() if g == "norm")
    assert {n for n, g in groups.items() if g == "embedding"} <= {"tok_embeddings.weight", "output.weight"}
    assert {n.split(".", 2)[2] for n, g in groups.items() if g == "router"} <= {"moe.router.gate.weight"}
    assert "bias" not in groups.values() and {"matrix", "embedding", "norm"} <= set(groups.values())
    assert ("router" in groups.values()) == ("moe" in flavor)
    if model == "qwen3":
        assert groups["layers.0.attention.q_norm.weight"] == "norm"
