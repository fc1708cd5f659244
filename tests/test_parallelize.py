"""parallelize.py's FSDP options reach fully_shard as configured: checked on a fake 4-rank world (no processes,
the model on meta), so every knob is shown to take effect; test_fsdp_options.py shows the loss curve is unchanged."""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan_lite.config import JobConfig, Parallelism
from torchtitan_lite.models.llama3.model import FLAVORS, Transformer
from torchtitan_lite.models.common.parallelize import tp_plan
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.parallelize import parallelize, reshard_after_forward, warn_ignored_options


@pytest.mark.parametrize("policy, blocks, last", [
    ("default", True, False), ("always", True, True), ("never", False, False), ("2", 2, False)])
def test_reshard_policy_per_module(policy, blocks, last):
    assert reshard_after_forward(policy, last_block=False) == blocks
    assert reshard_after_forward(policy, last_block=True) is last


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def fsdp_model(**parallelism) -> Transformer:
    cfg = JobConfig()
    cfg.training.mixed_precision_param, cfg.training.mixed_precision_output = "bfloat16", "float32"
    for k, v in parallelism.items():
        setattr(cfg.parallelism, k, v)
    dims = ParallelDims.from_config(cfg.parallelism, 4)
    with torch.device("meta"):
        model = Transformer(FLAVORS["debugmodel"].with_(vocab_size=256))
    parallelize(model, dims.build_mesh("cpu")[0], dims, cfg, tp_plan)
    return model


def state(module):
    return module._get_fsdp_state()  # private, but the only place FSDP2 keeps what it was given


def group(module):
    return state(module)._fsdp_param_group


def test_fsdp_options_take_effect(fake_world):
    model = fsdp_model(fsdp_reshard_after_forward="2", fsdp_cpu_offload=True, fsdp_offload_pin_memory=False,
                       fsdp_prefetch=2)
    blocks = list(model.layers.values())
    # hpZ: blocks but the last reshard to groups of 2 of the 4 shards; the last block and the root stay gathered.
    assert [g.post_forward_mesh_info and g.post_forward_mesh_info.shard_mesh_size
            for g in map(group, blocks)] == [2] * 5 + [None]
    assert group(model).post_forward_mesh_info is None
    assert all(type(group(m).offload_policy).__name__ == "CPUOffloadPolicy" for m in [*blocks, model])
    assert not group(model).offload_policy.pin_memory
    assert state(blocks[0])._states_to_forward_prefetch == [state(b) for b in blocks[1:3]]
    assert state(blocks[5])._states_to_backward_prefetch == [state(b) for b in (blocks[4], blocks[3])]
    assert state(blocks[5])._states_to_forward_prefetch == []
    # The output cast applies to the model's output alone; blocks hand bf16 activations to each other.
    assert state(model)._mp_policy.output_dtype == torch.float32
    assert state(blocks[0])._mp_policy.output_dtype is None
    assert state(blocks[0])._mp_policy.param_dtype == torch.bfloat16


def test_fsdp_defaults(fake_world):
    model = fsdp_model()
    blocks = list(model.layers.values())
    assert [group(b).post_forward_mesh_info is not None for b in blocks] == [True] * 5 + [False]
    assert type(group(model).offload_policy).__name__ == "OffloadPolicy"
    assert state(blocks[0])._states_to_forward_prefetch in (None, [])


def test_bf16_compute_keeps_the_rope_table_exact():
    """FSDP's MixedPrecisionPolicy casts each block's floating-point inputs to the param dtype: a real-valued rotary
    table passed to the blocks would reach attention in bf16. The complex table is left alone."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_lite.parallel.parallelize import apply_fsdp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = JobConfig()  # mixed_precision_param defaults to bfloat16
        model = Transformer(FLAVORS["debugmodel"].with_(vocab_size=256, n_layers=1, max_seq_len=8))
        apply_fsdp(model, init_device_mesh("cpu", (1,)), cfg)
        seen = []
        model.layers["0"].attention.register_forward_pre_hook(lambda m, args: seen.append(args[1].dtype))
        model(torch.zeros(1, 8, dtype=torch.long))
        assert seen == [torch.complex64]
    finally:
        dist.destroy_process_group()


SET = {"fsdp_prefetch": 2, "pipeline_parallel_schedule": "GPipe", "pipeline_parallel_microbatches": 4,
       "pipeline_parallel_layers_per_stage": 3, "context_parallel_load_balancer": "none"}


@pytest.mark.parametrize("dims, ignored", [
    (ParallelDims(1, 1, 1, 1), list(SET)),  # one process: every one of them
    (ParallelDims(1, 2, 1, 2), ["pipeline_parallel_schedule", "pipeline_parallel_microbatches",
                                "pipeline_parallel_layers_per_stage", "context_parallel_load_balancer"]),
    (ParallelDims(1, 1, 1, 2, pp=2), ["fsdp_prefetch", "context_parallel_load_balancer"]),
    (ParallelDims(1, 1, 1, 2, cp=2), ["pipeline_parallel_schedule", "pipeline_parallel_microbatches",
                                      "pipeline_parallel_layers_per_stage"]),  # CP alone still gets FSDP
    (ParallelDims(1, 2, 1, 8, pp=2, cp=2), []),
])
def test_options_the_layout_ignores_are_one_warning(caplog, dims, ignored):
    cfg = JobConfig()
    cfg.parallelism = Parallelism(**SET)
    warn_ignored_options(cfg, dims)
    named = [k for k in SET if f"parallelism.{k}" in caplog.text]
    assert named == ignored and len(caplog.records) == (1 if ignored else 0)
    if "fsdp_prefetch" in ignored:
        assert "no data parallelism in this layout, so FSDP is not applied: parallelism.fsdp_prefetch ignored" \
            in caplog.text
    caplog.clear()
    warn_ignored_options(JobConfig(), dims)  # defaults are never reported
    assert not caplog.records


@pytest.mark.parametrize("dims, warned", [(ParallelDims(1, 1, 1, 1), "training.mixed_precision_reduce"),
                                          (ParallelDims(1, 2, 1, 4, pp=2), "parallelism.fsdp_defer_grad_reduce"),
                                          (ParallelDims(1, 4, 1, 4), None)])
def test_the_reduce_dtype_without_fsdp_and_deferring_under_pp_are_warned(caplog, dims, warned):
    cfg = JobConfig()
    cfg.training.mixed_precision_reduce, cfg.parallelism.fsdp_defer_grad_reduce = "bfloat16", True
    warn_ignored_options(cfg, dims)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == (warned is not None) and all(f"{warned} ignored" in m for m in messages), messages


@pytest.mark.parametrize("dims, fsdp", [(ParallelDims(1, 1, 1, 1), False), (ParallelDims(1, 1, 2, 2), False),
                                        (ParallelDims(1, 1, 1, 2, pp=2), False), (ParallelDims(1, 4, 1, 4), True),
                                        (ParallelDims(2, 1, 1, 2), True)])  # HSDP of shard 1: DDP, still FSDP's policy
def test_fsdp_mixed_precision_options_without_fsdp_are_named_in_the_one_warning(caplog, dims, fsdp):
    """mixed_precision_output and _cast_forward_inputs shape FSDP's MixedPrecisionPolicy, as the reduce dtype does:
    one line names every one set away from its default where no FSDP reads them."""
    cfg = JobConfig()
    cfg.training.mixed_precision_output, cfg.training.mixed_precision_cast_forward_inputs = "float32", False
    cfg.training.mixed_precision_reduce = "bfloat16"
    warn_ignored_options(cfg, dims)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ([] if fsdp else [
        "no FSDP in this layout, so no mixed-precision policy: training.mixed_precision_reduce, "
        "training.mixed_precision_output, training.mixed_precision_cast_forward_inputs ignored"])
    caplog.clear()
    cfg.training.mixed_precision_reduce = "float32"  # each one alone is named too
    cfg.training.mixed_precision_cast_forward_inputs = True
    warn_ignored_options(cfg, dims)
    assert [r.getMessage() for r in caplog.records] == ([] if fsdp else [
        "no FSDP in this layout, so no mixed-precision policy: training.mixed_precision_output ignored"])
