"""What the config makes of a mixture of experts (models/common/moe.py): the [moe] keys over a flavor's mixture,
and what --check refuses, in one line, while a combination is not built (tests/test_moe.py: the layer itself)."""

import pytest
import torch

from torchtitan_lite.config import ConfigError, load_config
from torchtitan_lite.models import registry
from torchtitan_lite.models.common import moe
from torchtitan_lite.models.llama3.model import Transformer
from torchtitan_lite.models.common.moe import MoEArgs
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.training.preflight import check_layout
from launch import TINY


def run_args(*overrides: str):
    cfg = load_config(["--job.config_file", str(TINY), *overrides])
    return registry.get("llama3").run_args(cfg, 256)


def test_the_config_overrides_the_flavors_moe_settings_and_can_make_a_dense_flavor_moe():
    assert run_args("--model.flavor", "tiny_moe").moe == MoEArgs(aux_loss_coeff=0.02)
    assert run_args("--model.flavor", "tiny_moe", "--moe.top_k", "1", "--moe.score_func", "sigmoid",
                    "--no-moe.renormalize", "--moe.aux_loss_coeff", "0").moe == MoEArgs(top_k=1, score_func="sigmoid",
                                                                                       renormalize=False)
    assert run_args("--model.flavor", "tiny").moe is None
    made = run_args("--model.flavor", "tiny", "--moe.num_experts", "4", "--moe.every", "2").moe
    assert made == MoEArgs(num_experts=4, every=2)
    with torch.device("meta"):
        model = Transformer(run_args("--model.flavor", "tiny", "--moe.num_experts", "4", "--moe.every", "2"))
    assert not model.layers["0"].moe_enabled and model.layers["1"].moe.experts.w1.shape[0] == 4


@pytest.mark.parametrize("overrides, said", [
    (["--model.flavor", "tiny", "--moe.top_k", "1"], "moe.top_k is set but model.flavor tiny is dense: set "
                                                     "moe.num_experts too"),
    (["--model.flavor", "tiny_moe", "--moe.top_k", "9"], "moe.top_k 9 exceeds the 8 routed experts"),
])
def test_moe_settings_that_name_no_model_are_one_line(error_line, overrides, said):
    assert said in error_line(1, overrides)



@pytest.mark.parametrize("world, overrides, said", [
    (1, ["--compile.enable"], "compiled in bfloat16 alone"),
    (1, ["--compile.enable", "--training.mixed_precision_param", "float16"], "compiled in bfloat16 alone"),
    (1, ["--float8.enable_float8_linear", "--float8.emulate"], "without float8 so far"),
    # Compiled under EP in pieces around the dispatch, in bf16 alone as without it.
    (2, ["--parallelism.expert_parallel_degree", "2", "--compile.enable"], "compiled in bfloat16 alone"),
    (1, ["--compile.enable", "--float8.enable_float8_linear", "--float8.emulate"], "without float8 so far"),
    # Compile under TP first: what no change of the precision fixes (this got the bf16 line, then this one).
    (2, ["--parallelism.tensor_parallel_degree", "2", "--compile.enable"], "eager under tensor parallelism so far"),
    (2, ["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--training.mixed_precision_param",
         "bfloat16", "--moe.aux_loss_coeff", "0"], "eager under tensor parallelism so far"),
])
def test_what_a_moe_model_does_not_train_with_yet_is_refused_in_one_line(error_line, world, overrides, said):
    line = error_line(world, ["--model.flavor", "tiny_moe", *overrides])
    assert "the model (model.flavor tiny_moe, [moe]) is a mixture of experts" in line and said in line, line


OP_SAC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
BALANCED = ["--moe.load_balance_coeff", "1e-3", "--moe.router_z_loss", "1e-3"]  # beside tiny_moe's auxiliary loss


@pytest.mark.parametrize("world, overrides", [
    (1, ["--compile.enable", "--training.mixed_precision_param", "bfloat16", *BALANCED]),
    (2, ["--parallelism.expert_parallel_degree", "2", "--compile.enable", "--training.mixed_precision_param",
         "bfloat16", *BALANCED, *OP_SAC]),
    (4, ["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "4", "--compile.enable",
         "--training.mixed_precision_param", "bfloat16", "--activation_checkpoint.mode", "full"]),
    (2, ["--parallelism.expert_parallel_degree", "2", *OP_SAC]),
    (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2", *OP_SAC]),
])
def test_compile_and_op_level_checkpointing_of_a_moe_model_pass_the_check(world, overrides):
    """Compile under expert parallelism (parallel/compile.py), with the router losses and the selection bias (on one
    process too) and any activation checkpointing; op-level selective checkpointing under EP and TP
    (parallel/selective_ac.py). The multi-process tests train each against its eager or uncheckpointed twin."""
    cfg = load_config(["--job.config_file", str(TINY), "--model.flavor", "tiny_moe", *overrides])
    check_layout(cfg, ParallelDims.from_config(cfg.parallelism, world), registry.get("llama3").run_args(cfg, 256))


@pytest.mark.parametrize("world, overrides, said", [
    (4, ["--model.flavor", "tiny_moe", "--parallelism.expert_parallel_degree", "3"],
     "parallelism.expert_parallel_degree 3 must divide dp_shard 4 = 4 (the ranks that route different tokens, which "
     "the experts' ranks are borrowed from): choose one of 1, 2, 4"),
    (4, ["--model.flavor", "tiny_moe", "--parallelism.context_parallel_degree", "2",
         "--parallelism.expert_parallel_degree", "8"],
     "parallelism.expert_parallel_degree 8 must divide dp_shard 2 x cp 2 = 4"),
    (8, ["--model.flavor", "tiny_moe", "--parallelism.tensor_parallel_degree", "2",
         "--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "16"],
     "parallelism.expert_parallel_degree 16 must divide dp_shard 2 x cp 2 x tp 2 = 8 (the ranks that route different "
     "tokens, which the experts' ranks are borrowed from): choose one of 1, 2, 4, 8"),
    (4, ["--model.flavor", "tiny_moe", "--moe.num_experts", "6", "--parallelism.expert_parallel_degree", "4"],
     "parallelism.expert_parallel_degree 4 must divide the 6 routed experts (moe.num_experts): choose one of 1, 2 "
     "(these divide 4, the ranks that route different tokens, too)"),
    (4, ["--model.flavor", "tiny_moe", "--moe.num_experts", "6", "--parallelism.expert_parallel_degree", "3"],
     "parallelism.expert_parallel_degree 3 must divide dp_shard 4 = 4 (the ranks that route different tokens, which "
     "the experts' ranks are borrowed from): choose one of 1, 2 (these divide the 6 routed experts too)"),
    (2, ["--parallelism.expert_parallel_degree", "2"],
     "parallelism.expert_parallel_degree 2 splits a mixture of experts' experts, and model.flavor tiny has none"),
    (4, ["--model.flavor", "tiny_moe", "--parallelism.data_parallel_replicate_degree", "4",
         "--parallelism.expert_parallel_degree", "2"], "must divide dp_shard 1 = 1"),
])
def test_an_expert_parallel_degree_that_cannot_split_is_one_line(error_line, world, overrides, said):
    line = error_line(world, overrides)
    assert said in line, line


@pytest.mark.parametrize("experts, world, layout", [
    (6, 4, []),
    (6, 8, ["--parallelism.tensor_parallel_degree", "2"]),
    (12, 8, ["--parallelism.data_parallel_replicate_degree", "2"]),
    (8, 8, ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    (4, 12, []),
])
def test_every_expert_parallel_degree_a_refusal_offers_passes_the_check(experts, world, layout):
    """Each degree from 1 to twice the world size through the layout's checks (dims, then the model's): every
    refusal offers exactly the degrees that pass, so whichever the user picks, the next check takes it."""
    passed, offered = set(), {}
    for ep in range(1, 2 * world + 1):
        cfg = load_config(["--job.config_file", str(TINY), "--model.flavor", "tiny_moe", "--moe.num_experts",
                           str(experts), *layout, "--parallelism.expert_parallel_degree", str(ep)])
        try:
            dims = ParallelDims.from_config(cfg.parallelism, world)
            check_layout(cfg, dims, registry.get("llama3").run_args(cfg, 256))
            passed.add(ep)
        except ConfigError as e:
            assert "choose one of " in str(e), e
            listed = str(e).split("choose one of ", 1)[1].split(" (", 1)[0]
            offered[ep] = {int(d) for d in listed.split(", ")}
    assert offered and passed
    assert all(degrees == passed for degrees in offered.values()), (passed, offered)
