"""The options: one dataclass per TOML section, each field's default, help, choices and rule (the values it accepts,
rules.py) written once in `opt(...)`. Everything else (job_config.py: TOML, `--section.key`, `--help`, validation)
walks these dataclasses, so adding an option is one line here and nothing else.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

from torchtitan_lite.config.paths import LIST, ONE
from torchtitan_lite.config.rules import WEEK, Rule, at_least, finite_above, finite_at_least, or_auto, within, words_or_count


class ConfigError(ValueError):
    """A problem with the user's configuration; the message is one line naming the key and the fix."""

def opt(default: Any, help: str, choices: tuple[str, ...] = (), rule: Rule | None = None, path: str = "") -> Any:
    metadata = {"help": help, "choices": choices, "rule": rule, "path": path}
    if isinstance(default, (list, dict)):  # a fresh one per instance: mutable defaults are shared otherwise
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Job:
    """where the config came from and where outputs go"""
    config_file: str = opt("", "TOML file the run was read from", path=ONE)
    dump_folder: str = opt("./outputs", "where config.toml, metrics.jsonl, checkpoints and tb/ go", path=ONE)
    description: str = opt("", "free text describing the run")
    print_args: bool = opt(False, "also print the resolved config at start-up (config.toml always holds it)")


@dataclass
class Model:
    """architecture and tokenizer"""
    name: str = opt("llama3", "architecture: a registered model spec (models/registry.py lists the built-in ones; "
                    "checked by the trainer)")
    flavor: str = opt("debugmodel", "size preset: a key of the model spec's flavor table (checked by the trainer)")
    tokenizer_path: str = opt("", '"" = byte-level tokenizer needing no file; else a tiktoken BPE file', path=ONE)
    attn_mask_type: str = opt("causal", "block_causal = attention and positions stop at document boundaries (BOS) "
                              "inside a packed window", choices=("causal", "block_causal"))
    mtp_depth: Optional[int] = opt(None, "DeepSeek-V3's multi-token prediction: modules predicting 2..D+1 tokens "
                                   "ahead, trained with training.mtp_weight; 0 = off; none = the flavor's",
                                   rule=at_least(0))


@dataclass
class Moe:
    """mixture of experts (models/common/moe.py): each setting overrides the flavor's; on a dense flavor, num_experts
    makes its blocks mixtures"""
    num_experts: Optional[int] = opt(None, "routed experts of an MoE block; none = the flavor's", rule=at_least(1))
    top_k: Optional[int] = opt(None, "routed experts a token goes to (at most num_experts); none = the flavor's",
                               rule=at_least(1))
    hidden: Optional[int] = opt(None, "a routed expert's hidden size, 0 = the dense feed-forward's; none = the "
                                "flavor's", rule=at_least(0))
    shared_experts: Optional[int] = opt(None, "experts every token goes to, each of that hidden size; none = the "
                                        "flavor's", rule=at_least(0))
    score_func: str = opt("", 'router scores: softmax over the experts (Mixtral) or each one\'s sigmoid '
                          '(DeepSeek-V3); "" = the flavor\'s', choices=("", "softmax", "sigmoid"))
    renormalize: Optional[bool] = opt(None, "divide a token's top-k weights by their sum; none = the flavor's")
    route_scale: Optional[float] = opt(None, "the weights' factor, after that; none = the flavor's",
                                       rule=finite_above(0))
    every: Optional[int] = opt(None, "every k-th block is MoE, the others dense; none = the flavor's",
                               rule=at_least(1))
    first_dense: Optional[int] = opt(None, "the first n blocks stay dense; none = the flavor's", rule=at_least(0))
    load_balance_coeff: Optional[float] = opt(None, "DeepSeek-V3's balancing: each step, a busy expert's bias "
                                              "goes down by this, an idle one's up (1e-3); 0 = off; none = the "
                                              "flavor's", rule=finite_at_least(0))
    aux_loss_coeff: Optional[float] = opt(None, "the Switch/Mixtral load-balancing loss's weight (Mixtral: 0.02), "
                                          "each sequence's own; 0 = off; none = the flavor's", rule=finite_at_least(0))
    n_group: Optional[int] = opt(None, "DeepSeek-V3's group-limited routing: the routed experts in this many equal "
                                 "groups; 1 = unlimited; none = the flavor's", rule=at_least(1))
    topk_group: Optional[int] = opt(None, "the best groups a token's experts are chosen within; none = the flavor's",
                                    rule=at_least(1))
    router_z_loss: Optional[float] = opt(None, "ST-MoE's router z-loss weight (1e-3): the mean over tokens and MoE "
                                         "layers of the gate logits' log-sum-exp squared; 0 = off; none = the "
                                         "flavor's", rule=finite_at_least(0))
    capacity_factor: Optional[float] = opt(None, "Megatron's expert capacity factor: an expert takes at most "
                                           "ceil(this x seq_len x top_k / num_experts) slots of each sequence, the "
                                           "later positions' dropped and logged (dropped); 0 = dropless; none = the "
                                           "flavor's", rule=finite_at_least(0, "0 = dropless"))


@dataclass
class Optimizer:
    """optimizer and its hyperparameters"""
    name: str = opt("AdamW", "optimizer: a registered one, AdamW or Muon (training/optim.py; checked by the trainer)")
    lr: float = opt(8e-4, "peak learning rate (Muon: of its matrices, and of the rest unless muon.adamw_lr)",
                    rule=finite_above(0))
    beta1: float = opt(0.9, "Adam first-moment decay", rule=within(0, 1, high_open=True))
    beta2: float = opt(0.95, "Adam second-moment decay", rule=within(0, 1, high_open=True))
    eps: float = opt(1e-8, "Adam denominator epsilon", rule=finite_above(0))
    weight_decay: float = opt(0.1, "decoupled weight decay", rule=finite_at_least(0))
    implementation: str = opt("fused", "kernel flavour of the (Adam) update", choices=("foreach", "fused", "for-loop"))


@dataclass
class Muon:
    """Muon (optimizer.name Muon, training/muon.py): orthogonalized momentum on the model's matrices, AdamW with the
    [optimizer] keys on the rest (embeddings, output, norms, routers)"""
    momentum: float = opt(0.95, "momentum of the matrices' updates", rule=within(0, 1, high_open=True))
    nesterov: bool = opt(True, "Nesterov momentum")
    ns_steps: int = opt(5, "Newton-Schulz steps of the orthogonalization (torch's 5)", rule=within(1, 99))
    adjust_lr: str = opt("match_rms_adamw", "a matrix's lr: match_rms_adamw (Moonlight: AdamW's lr and weight decay "
                         "carry over) or original (Keller Jordan's)", choices=("match_rms_adamw", "original"))
    adamw_lr: Optional[float] = opt(None, "peak lr of the parameters AdamW updates; none = optimizer.lr",
                                    rule=finite_above(0))


@dataclass
class LRScheduler:
    """warmup, then a constant stretch, then decay"""
    warmup_steps: int = opt(200, "steps of linear warmup from ~0 to lr", rule=at_least(0))
    decay_ratio: Optional[float] = opt(None, "fraction of steps spent decaying at the end; none = all after warmup",
                                       rule=within(0, 1))
    decay_type: str = opt("linear", "shape of the decay", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = opt(0.0, "lr at the end of decay, as a fraction of lr", rule=within(0, 1))


@dataclass
class Training:
    """batch, length, duration, data and precision"""
    local_batch_size: int = opt(8, "sequences per device per micro-batch", rule=at_least(1))
    global_batch_size: int = opt(-1, "-1 = local x data-parallel degree; larger multiples accumulate gradients",
                                 rule=or_auto(at_least(1), "local x data-parallel degree"))
    seq_len: int = opt(2048, "tokens per sequence", rule=at_least(2))  # inputs and next-token targets
    steps: int = opt(10000, "optimizer steps to train for", rule=at_least(1))
    max_norm: float = opt(1.0, "gradient clipping norm; 0 disables", rule=finite_at_least(0, "0 disables clipping"))
    dataset: str = opt("synthetic", "training dataset name")
    dataset_path: str = opt("", "local path of the dataset, if it needs one", path=LIST)
    dataset_text_field: str = opt("text", "jsonl and hf datasets: the field that holds a document's text")
    mixed_precision_param: str = opt("bfloat16", "compute dtype; float16 adds loss scaling",
                                     choices=("bfloat16", "float32", "float16"))
    mixed_precision_reduce: str = opt("float32", "FSDP gradient reduce dtype", choices=("float32", "bfloat16"))
    mixed_precision_output: str = opt("none", "output dtype", choices=("none", "float32", "bfloat16", "float16"))
    mixed_precision_cast_forward_inputs: bool = opt(True, "FSDP casts sharded modules' float inputs to param dtype")
    seed: int = opt(0, "random seed", rule=Rule("in [0, 2**64)", lambda v: 0 <= v < 2**64))  # what torch takes
    deterministic: bool = opt(False, "torch.use_deterministic_algorithms, for bitwise-reproducible runs")
    layout_invariant: bool = opt(False, "every layout gives the single process's bits, summing in one order "
                                 "(docs/layout_invariance.md); refuses what it does not cover")
    layout_invariant_cp: int = opt(1, "training.layout_invariant's context-parallel order: 2 computes every layout in "
                                   "CP 2's token halves, so context_parallel_degree 2 gives the same bits too",
                                   rule=Rule("1 or 2", lambda v: v in (1, 2)))
    skip_nonfinite_steps: int = opt(0, "a NaN/Inf gradient norm stops the run; N > 0 skips up to N such in a row",
                                    rule=at_least(0))
    z_loss: float = opt(0.0, "PaLM's z-loss weight (1e-4): the mean over tokens of the output logits' log-sum-exp "
                        "squared, added to the loss trained and logged apart as z_loss; 0 = off",
                        rule=finite_at_least(0, "0 = off"))
    mtp_weight: float = opt(0.1, "the multi-token prediction loss's weight (model.mtp_depth; DeepSeek-V3: 0.3, "
                            "then 0.1): the mean of its depths' losses, logged apart as mtp_loss",
                            rule=finite_at_least(0))
    gc_freq: int = opt(50, "Python GC every N steps, so ranks pause together; 0 leaves automatic GC on",
                       rule=at_least(0, "0 leaves automatic GC on"))


@dataclass
class Parallelism:
    """device mesh degrees; they must multiply to the world size"""
    data_parallel_replicate_degree: int = opt(1, "copies of the model (HSDP across nodes)", rule=at_least(1))
    data_parallel_shard_degree: int = opt(-1, "FSDP shards; -1 = the rest of the world size",
                                          rule=or_auto(at_least(1), "the rest of the world"))
    tensor_parallel_degree: int = opt(1, "heads and FFN split across this many devices", rule=at_least(1))
    disable_loss_parallel: bool = opt(False, "gather logits before the loss instead of a sharded loss under TP")
    fsdp_reshard_after_forward: str = opt(
        "default", "after forward: default (every block but the last), always, never, or N = keep parameters "
        "sharded over groups of N ranks (hpZ; N divides the shard degree) so backward's all-gather stays within them",
        rule=words_or_count(("default", "always", "never"), "default, always, never or a group size >= 1"))
    fsdp_cpu_offload: bool = opt(False, "sharded params, grads and optimizer state in host memory; AdamW runs there")
    fsdp_offload_pin_memory: bool = opt(True, "offload into page-locked host memory (faster copies; needs a GPU)")
    fsdp_prefetch: int = opt(0, "all-gather the next N blocks ahead in forward and backward; 0 = FSDP2's implicit one",
                             rule=at_least(0))
    fsdp_defer_grad_reduce: bool = opt(False, "accumulation: reduce gradients after the last micro-batch only")
    pipeline_parallel_degree: int = opt(1, "pipeline stages across this many ranks (the outermost mesh dim)",
                                        rule=at_least(1))
    pipeline_parallel_schedule: str = opt("1F1B", "torch's schedule name: GPipe, 1F1B, Interleaved1F1B, LoopedBFS")
    pipeline_parallel_microbatches: int = opt(-1, "micro-batches per local batch; -1 = the pipeline degree",
                                              rule=or_auto(at_least(1)))
    pipeline_parallel_layers_per_stage: int = opt(
        -1, "blocks per stage; -1 = split over 1 stage a rank (docs/parallelism.md#pipeline-parallelism)",
        rule=or_auto(at_least(1)))
    context_parallel_degree: int = opt(1, "each sequence split across this many ranks (long context; "
                                       "docs/parallelism.md#long-sequences-context-parallelism)", rule=at_least(1))
    expert_parallel_degree: int = opt(1, "a mixture of experts' routed experts split across this many of the "
                                      "ranks that route different tokens (dp_shard x cp x tp), tokens sent to them "
                                      "by all-to-all (docs/moe.md); 1 = off",
                                      rule=at_least(1))
    context_parallel_load_balancer: str = opt("headtail", "a rank's share of the sequence: headtail = chunks i and "
                                              "2cp-1-i (equal causal work), none = one contiguous chunk",
                                              choices=("headtail", "none"))


@dataclass
class Comm:
    """how long a rank waits for its peers before the job is ended as hung"""
    init_timeout_seconds: int = opt(600, "collective timeout from start-up through the first step (which may compile)",
                                    rule=within(1, WEEK))
    train_timeout_seconds: int = opt(100, "collective timeout once training is under way", rule=within(1, WEEK))
    trace_buf_size: int = opt(20000, "flight-recorder entries per rank (torch's record of each collective, written "
                              "to comm_traces/ when one times out); 0 = off", rule=at_least(0, "0 = off"))


@dataclass
class Checkpoint:
    """saving and resuming (DCP)"""
    enable: bool = opt(False, "save checkpoints and resume from the newest one")
    folder: str = opt("checkpoint", "checkpoint folder, under job.dump_folder")
    interval: int = opt(500, "save every N steps", rule=at_least(1))
    continue_on_save_error: bool = opt(False, "a failed save (full disk) is reported and training goes on")
    keep_latest_k: int = opt(0, "keep only the newest K checkpoints; 0 keeps all", rule=at_least(0, "0 keeps all"))
    async_mode: str = opt("disabled", "save in the background", choices=("disabled", "async"))
    last_save_model_only: bool = opt(False, "the final save holds weights only (smaller, but cannot be resumed)")
    export_dtype: str = opt("float32", "dtype of a model-only save", choices=("float32", "bfloat16", "float16"))
    create_seed_checkpoint: bool = opt(False, "write the initial weights at step 0 and exit")
    load_step: int = opt(-1, "step to resume from; -1 = newest complete checkpoint",
                         rule=or_auto(at_least(0), "the newest complete checkpoint"))
    initial_load_path: str = opt("", "checkpoint to start from when the folder holds none", path=ONE)
    initial_load_model_only: bool = opt(True, "load only weights from initial_load_path")
    initial_load_in_hf: bool = opt(False, "initial_load_path is a Hugging Face folder (config.json + safetensors); "
                                   "its tokenizer too unless model.tokenizer_path names one")
    last_save_in_hf: bool = opt(False, "the final save also written as a Hugging Face folder, step-N-hf beside "
                                "step-N")


@dataclass
class ActivationCheckpoint:
    """recompute activations in backward to save memory"""
    mode: str = opt("none", "what to recompute", choices=("none", "full", "selective"))
    selective_ac_option: str = opt("2", '"op" (per-op policy) or N: checkpoint every N-th block',
                                   rule=words_or_count(("op",), '"op" or a positive integer'))


@dataclass
class Compile:
    """torch.compile"""
    enable: bool = opt(False, "compile each transformer block")
    backend: str = opt("inductor", "torch.compile backend (aot_eager: traced, not code-generated)",
                       choices=("inductor", "aot_eager", "eager"))


@dataclass
class Float8:
    """float8 matmuls through torchao (docs/float8.md), and MXFP8 for a mixture's routed experts (docs/moe.md)"""
    enable_float8_linear: bool = opt(False, "the blocks' linears multiply in float8 (torchao: pip install torchao)")
    recipe_name: str = opt("tensorwise", "scaling: tensorwise (one scale a tensor: fastest, float8 all-gathers), "
                           "rowwise (a scale a row), rowwise_with_gw_hp (weight gradients in high precision)",
                           choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    enable_fsdp_float8_all_gather: bool = opt(False, "tensorwise: FSDP all-gathers converted weights in float8, 1 "
                                              "byte an element")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(False, "with the float8 all-gather: every weight's scale "
                                                         "in one all-reduce after the optimizer step")
    filter_fqns: list[str] = opt([], "linears kept in high precision: those whose name contains an entry (each must "
                                 "match one); the output layer never converts")
    emulate: bool = opt(False, "float8 (and MXFP8) matmuls emulated in high precision, for the CPU and GPUs below "
                        "SM89 (MXFP8: other than SM100): the numerics without the speed")
    moe_fqns: list[str] = opt([], "routed experts whose grouped matmuls run in MXFP8 (torchao's moe_training, "
                              "torchtitan's quantize.grouped_mm.mx.fqns): those whose name contains an entry, e.g. "
                              "experts (each must match some); [] = off")
    moe_recipe_name: str = opt("mxfp8", "the experts' MXFP8: mxfp8 (every matmul, forward and backward) or "
                               "mxfp8_wgrad_with_hp (weight gradients in high precision; also under TP and CP)",
                               choices=("mxfp8", "mxfp8_wgrad_with_hp"))


@dataclass
class Metrics:
    """logging"""
    log_freq: int = opt(10, "log every N steps", rule=at_least(1))
    enable_tensorboard: bool = opt(False, "also write TensorBoard events")
    save_tb_folder: str = opt("tb", "TensorBoard folder, under job.dump_folder")
    enable_wandb: bool = opt(False, "also log to Weights & Biases (pip install wandb; WANDB_* variables: "
                             "docs/observability.md#weights--biases)")
    straggler_factor: float = opt(1.5, "warn when a rank's step or data wait runs this many median steps slower "
                                  "at 3 logging steps in a row", rule=finite_above(1))


@dataclass
class Profiling:
    """torch.profiler traces and memory snapshots (docs/observability.md)"""
    enable_profiling: bool = opt(False, "write a torch.profiler trace of each rank every profile_freq steps")
    save_traces_folder: str = opt("profile_traces", "trace folder, under job.dump_folder")
    profile_freq: int = opt(10, "steps between traces (and memory snapshots); the traced steps are its multiples",
                            rule=at_least(1))
    profiler_warmup: int = opt(3, "steps the profiler runs untraced before each traced window", rule=at_least(0))
    profiler_active: int = opt(1, "steps traced per window", rule=at_least(1))
    enable_memory_snapshot: bool = opt(False, "GPU: allocator history, a snapshot every profile_freq steps; CPU: the "
                                       "traces' memory timeline")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "snapshot folder, under job.dump_folder")


@dataclass
class Validation:
    """periodic evaluation on held-out data"""
    enable: bool = opt(False, "run validation during training")
    dataset: str = opt("", '"" = the training data\'s held-out part (docs/data.md#sources); else a dataset')
    dataset_path: str = opt("", "local path of that dataset, if it needs one", path=LIST)
    freq: int = opt(100, "validate every N steps", rule=at_least(1))
    steps: int = opt(10, "batches per validation", rule=at_least(1))


@dataclass
class Source:
    """one [[mixture.sources]] table: a dataset and its share of every global batch"""
    name: str = opt("", "unique; keys the source's order, its metrics (val_loss/NAME) and its checkpoint state")
    dataset: str = opt("python_stdlib", "any training.dataset kind: synthetic, python_stdlib, text, jsonl, tokens, hf")
    dataset_path: str = opt("", "local path of the dataset, if it needs one", path=LIST)
    text_field: str = opt("text", "jsonl and hf datasets: the field that holds a document's text")
    weight: float = opt(1.0, "share of each global batch until the first phase (weights are normalized)",
                        rule=finite_at_least(0))
    max_epochs: float = opt(0.0, "passes over the source training.steps may take at most; 0 = no cap",
                            rule=finite_at_least(0, "no cap"))
    validation_path: str = opt("", '"" = the held-out part of the source (as validation.dataset ""); else its files',
                               path=LIST)


@dataclass
class Phase:
    """one [[mixture.phases]] table: new weights once start_step steps are done (annealing)"""
    start_step: int = opt(1, "steps trained before these weights apply", rule=at_least(1))
    weights: dict[str, float] = opt({}, "NAME = weight for every source (an inline table); missing names weigh 0")


@dataclass
class Mixture:
    """weighted data sources and phases; training.dataset = "mixture" selects them (docs/data.md#mixtures)"""
    sources: list[Source] = opt([], "the sources, one [[mixture.sources]] table each")
    phases: list[Phase] = opt([], "later weights, one [[mixture.phases]] table each, in step order")
    weights: str = opt("", '"" = the sources\' weights; else NAME=W,NAME=W replaces them (the command line\'s form)')


@dataclass
class FaultTolerance:
    """replica groups that outlive each other's failures (torchft, optional: docs/fault_tolerance.md#replica-groups)"""
    enable: bool = opt(False, "this job is one of group_size replica groups: they sum their gradients each step, "
                       "and a group that fails restarts and heals from a live one while the others train on")
    replica_id: int = opt(0, "this group's number, 0 to group_size - 1", rule=at_least(0))
    group_size: int = opt(1, "replica groups in the run; each trains a share of every global batch",
                          rule=at_least(1))
    min_replica_size: int = opt(1, "groups that must be alive to commit a step; fewer wait for more, "
                                "quorum_timeout_ms at most, then stop", rule=at_least(1))
    mode: str = opt("exact", 'a missing group\'s share of the global batch: "exact" = the live groups train it (the '
                    'uninterrupted curve), "fast" = skipped, and named in metrics.jsonl (skipped_samples)',
                    choices=("exact", "fast"))
    groups_per_machine: int = opt(1, "groups that share this machine's CPU cores: a CPU process computes with its "
                                  "share of them, as the processes of one job do", rule=at_least(1))
    lighthouse: str = opt("", 'the torchft lighthouse every group asks who is alive, http://HOST:PORT; "" = '
                          "$TORCHFT_LIGHTHOUSE")
    process_group_timeout_ms: int = opt(10000, "a cross-group collective waits this long for a silent group before "
                                        "the step is retried without it", rule=within(1, WEEK * 1000))
    quorum_timeout_ms: int = opt(600000, "a group asking who is alive waits this long for the others to end their "
                                 "step (a checkpoint save included); keep the lighthouse's join timeout as long",
                                 rule=within(1, WEEK * 1000))


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    moe: Moe = field(default_factory=Moe)
    optimizer: Optimizer = field(default_factory=Optimizer)
    muon: Muon = field(default_factory=Muon)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    comm: Comm = field(default_factory=Comm)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    validation: Validation = field(default_factory=Validation)
    mixture: Mixture = field(default_factory=Mixture)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
