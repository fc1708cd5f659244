"""Everything that can be checked before any process talks to another, so a bad config fails on every rank the same
way instead of hanging in a collective. `train.py --check` runs `preflight` alone (run_train.sh, before torchrun);
the memory estimator runs `check_layout`, its part that needs neither data nor a tokenizer file, so it refuses
exactly the layouts the trainer refuses.
"""

from __future__ import annotations

import torch

from torchtitan_lite.checkpoint.hf_load import check_hf
from torchtitan_lite.checkpoint.manager import check_config
from torchtitan_lite.config import ConfigError, JobConfig
from torchtitan_lite.data.mixture import build_data
from torchtitan_lite.data.hf_tokenizer import run_tokenizer, run_vocab_size
from torchtitan_lite.models import registry
from torchtitan_lite.models.common import capacity
from torchtitan_lite.models.spec import Args
from torchtitan_lite.parallel.context_parallel import check_cp
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.pipeline import check_pipeline
from torchtitan_lite.quantization import float8, mxfp8_experts
from torchtitan_lite.runtime.profiling import check_profiling
from torchtitan_lite.runtime.wandb_run import check_wandb
from torchtitan_lite.training import layout_invariant
from torchtitan_lite.training.optimizers import check_optimizer
from torchtitan_lite.training.replica_config import check_replicas


def check_layout(cfg: JobConfig, dims: ParallelDims, model_args: Args) -> None:
    """The model and the sequence cut the way the mesh says: heads over TP, blocks into pipeline stages, CP chunks."""
    spec = registry.get(cfg.model.name)
    dims.validate_model(spec.tp_sizes(model_args))
    if dims.pp > 1:
        check_pipeline(cfg.parallelism, model_args.n_layers, cfg.training.local_batch_size)
    if dims.cp > 1:
        check_cp(cfg.training.seq_len, dims.cp, dims.tp, cfg.parallelism.context_parallel_load_balancer)
        if not hasattr(spec.model_class, "attend_with"):
            raise ConfigError(f"model {spec.name} has no swappable attention (attend_with), which context parallelism "
                              "swaps: set parallelism.context_parallel_degree = 1")
    moe = spec.moe(model_args)
    if moe is not None:
        check_moe(cfg, dims, moe)
    elif dims.ep > 1:
        raise ConfigError(f"parallelism.expert_parallel_degree {dims.ep} splits a mixture of experts' experts, and "
                          f"model.flavor {cfg.model.flavor} has none: set it to 1, or set moe.num_experts")
    if float8.enabled(cfg):
        with torch.device("meta"):
            float8.check(cfg, spec.model_class(model_args), dims)
    if mxfp8_experts.enabled(cfg):
        with torch.device("meta"):
            mxfp8_experts.check(cfg, spec.model_class(model_args), dims)
    layout_invariant.check(cfg, dims, model_args)


def check_moe(cfg: JobConfig, dims: ParallelDims, moe) -> None:
    """What a mixture-of-experts model trains with so far: every layout (a token's route and experts are its own,
    whichever rank holds it) and expert parallelism within it, any precision and activation checkpointing, compile in
    bf16 without TP (under EP in pieces around the dispatch: parallel/compile.py), its losses and balancing too.

    What no other setting makes possible is refused first (compile with TP, float8): a user who fixed the precision
    for compile would only meet it next."""
    flavor = f"the model (model.flavor {cfg.model.flavor}, [moe]) is a mixture of experts, which trains"
    if dims.tp > 1 and cfg.compile.enable:
        raise ConfigError(f"{flavor} eager under tensor parallelism so far (there each mixture is an FSDP unit of "
                          "its own inside its block, whose hooks torch 2.13's dynamo refuses to trace): drop "
                          "compile.enable or set parallelism.tensor_parallel_degree 1")
    if float8.enabled(cfg):
        raise ConfigError(f"{flavor} without float8 so far on its linears (float8 would convert routers' gates, "
                          "which score in fp32, and shared experts: untested): drop float8.enable_float8_linear; "
                          "float8.moe_fqns runs the routed experts in MXFP8")
    dims.check_experts(moe.num_experts)
    capacity.check(moe, cfg.training.seq_len)
    if cfg.compile.enable and cfg.training.mixed_precision_param != "bfloat16":
        raise ConfigError(f"{flavor} compiled in bfloat16 alone (compile's grouped GEMM takes bf16, and the "
                          "per-expert loop reads its counts on the host): set training.mixed_precision_param "
                          "bfloat16 or drop compile.enable")
    if moe.capacity_factor > 0 and cfg.compile.enable:
        raise ConfigError(f"{flavor} with a capacity factor eager so far (the kept slots, the experts' rows, are "
                          "counted on the host: a shape a compiled graph cannot know): drop compile.enable or set "
                          "moe.capacity_factor 0")


def document_start(cfg: JobConfig, tokenizer) -> int | None:
    """The token that starts a document under block_causal (the tokenizer's BOS), None when causal; refuses data
    that has no documents."""
    if cfg.model.attn_mask_type == "causal":
        return None
    mixed = [s.dataset for s in cfg.mixture.sources] if cfg.training.dataset == "mixture" else []
    if set(mixed or [cfg.training.dataset]) == {"synthetic"}:  # in a mixture beside text, its windows are causal
        raise ConfigError("model.attn_mask_type block_causal masks at document starts (BOS), and synthetic data has "
                          "no documents: train on text (e.g. training.dataset python_stdlib) or use causal")
    if tokenizer.bos_id is None:  # Qwen's: documents are text + EOS, and where one starts is not a token
        raise ConfigError("model.attn_mask_type block_causal masks at document starts (BOS), and the tokenizer has "
                          "no BOS (its documents are text + EOS): use causal")
    return tokenizer.bos_id


def preflight(cfg: JobConfig, world_size: int):
    """The trainer's checks: (dims, model args, the token that starts a document under block_causal or None, global
    batch, training source, validation sources by name: {"": one} for one dataset, one per source for a mixture, {}
    with validation off), or a ConfigError that names the problem and the fix."""
    spec = registry.get(cfg.model.name)  # first: the rest of the checks are the model's
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    tokenizer = run_tokenizer(cfg)  # model.tokenizer_path's, or the Hugging Face folder's the run starts from
    model_args = spec.run_args(cfg, run_vocab_size(cfg, tokenizer))  # the tokenizer's, or a folder's padded one
    check_layout(cfg, dims, model_args)
    check_optimizer(cfg, spec.param_group)
    check_config(cfg.checkpoint, world_size, cfg.job.dump_folder)
    check_hf(cfg, model_args)
    check_profiling(cfg.profiling, world_size)
    check_wandb(cfg.metrics.enable_wandb)
    bos_id = document_start(cfg, tokenizer)
    training = cfg.training
    global_batch = dims.global_batch(training.local_batch_size, training.global_batch_size)
    global_batch = check_replicas(cfg, dims, global_batch, spec.moe(model_args) is not None)
    source, val_sources = build_data(cfg, tokenizer, global_batch, dims.dp)
    return dims, model_args, bos_id, global_batch, source, val_sources
