"""The suite's shared runs, by name: what each trains (processes, train.py overrides beside launch.COMMON, the
model), which single-process run it is compared with, which record their gradients, and which are resumed or
resharded. conftest.py makes them (SharedRuns), the tests import these tables to parametrize over them: a plain
module, imported once, so the pair rows are generated once per session.

A name is a label: what kind of run it is (pipelined, context parallel, compiled) is read from its config as the
trainer parses it (`Run.dims`, `Run.config`, `of_kind`), so renaming a run changes no test that selects by kind. A
new architecture joins the parity matrix as table entries with its `model` and a single-process reference run of its
own: test_layouts.py compares every shared run with its `reference`, and test_run_table.py checks that a reference is
one process training what its runs train."""

from __future__ import annotations

import pairs
from invariant_runs import INVARIANT_RESUMED, INVARIANT_RUNS
from launch import (BALANCED, CHECKPOINTED, CP2, DEBUGMODEL, EP2, EP4, FLOAT8, HSDP, MASKED, MOE, PP2, PROFILED, QWEN3,
                    QWEN3_MOE, TP2, TP2_FSDP2)
from run_spec import KINDS, SHORT, Resumed, Run, of_kind  # noqa: F401 - the tables' readers import them from here


# name -> Run, all with global batch 8. One process and DDP accumulate; the 4-process layouts take one micro-batch per
# rank (under TP each costs ~8 collectives per block; test_checkpoint.py accumulates on TP 2 x 2).
SHARED_RUNS = {
    "single": Run(1, (), reference=None),  # 4 micro-batches of 2
    # 1 of 2 per rank; traced at steps 4 and 8 (test_profiling.py: profiling changes no number the others read).
    "fsdp4": Run(4, (*CHECKPOINTED, *PROFILED)),
    # 1 of 4 per rank, each block recomputed in backward: AC leaves the numerics alone (the TP 2 x FSDP 2 reshard leg
    # of test_checkpoint.py runs without it).
    "tp2_fsdp2": Run(4, TP2_FSDP2),
    # Read by the layout test alone, which compares the steps both runs have: 4 show parity as well as 8.
    "tp4": Run(4, ("--parallelism.tensor_parallel_degree", "4", "--training.local_batch_size", "8", *SHORT)),  # 1 of 8
    "hsdp2x2": Run(4, (*HSDP, *SHORT)),  # 1 of 2 per rank
    # DDP is FSDP2 on a (replicate, shard = 1) mesh; 2 replicas show it as well as 4. 2 micro-batches of 2 per rank.
    "ddp2": Run(2, ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                    "1", *SHORT)),
    # Pipeline layouts, one per schedule, recording every parameter's gradient at step 1 (grad_dump.py). GPipe: 2
    # local batches of 4 accumulated, 2 micro-batches each; 1F1B beside FSDP, validating and saving every 2 steps.
    # FSDP2's options (test_fsdp_options.py). hpZ over pairs of the 4 shards, two blocks prefetched each way, and 2
    # micro-batches of 1 per rank reduced once after the last; the output and input casts are fp32 here, so they are
    # only shown to run. Then parameters, gradients and AdamW's state in host memory (the device is the host here).
    "fsdp4_hpz_prefetch_deferred_reduce": Run(4, (
        "--parallelism.fsdp_reshard_after_forward", "2", "--parallelism.fsdp_prefetch", "2",
        "--training.local_batch_size", "1", "--parallelism.fsdp_defer_grad_reduce",
        "--training.mixed_precision_output", "float32", "--no-training.mixed_precision_cast_forward_inputs", *SHORT)),
    "fsdp4_offload_reshard_always": Run(4, (
        "--parallelism.fsdp_cpu_offload", "--no-parallelism.fsdp_offload_pin_memory",
        "--parallelism.fsdp_reshard_after_forward", "always", *SHORT)),
    # TP 2 compiled (aot_eager), validating and saving every 2 steps: test_compile.py resumes it.
    "tp2_compiled": Run(2, (*TP2, "--training.local_batch_size", "4", "--compile.enable", "--compile.backend",
                            "aot_eager", *CHECKPOINTED, "--validation.enable", "--validation.freq", "2",
                            "--validation.steps", "1", "--training.steps", "6")),
    "pp2_gpipe": Run(2, (*PP2, "--parallelism.pipeline_parallel_schedule", "GPipe", "--training.local_batch_size", "4",
                         *CHECKPOINTED)),
    "pp2_fsdp2": Run(4, (*PP2, "--training.local_batch_size", "4", *CHECKPOINTED, "--validation.enable",
                         "--validation.freq", "2", "--validation.steps", "2")),
    # 4 stages of the debug model's 6 blocks (1, 2, 2, 1: the end ones hold the embedding and the output), 2 per rank,
    # 4 micro-batches of 2, every block recomputed in backward; interleaved with blocks compiled (aot_eager). Both
    # against a single-process run of the debug model (SINGLES).
    "pp2_tp2_looped_bfs": Run(4, (*PP2, *TP2, "--parallelism.pipeline_parallel_schedule", "LoopedBFS",
                                  "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_microbatches",
                                  "4", "--activation_checkpoint.mode", "full", *DEBUGMODEL, *SHORT),
                              reference="single_debugmodel"),
    "pp2_interleaved_compiled": Run(2, (*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                        "--training.local_batch_size", "8",
                                        "--parallelism.pipeline_parallel_microbatches", "4", "--compile.enable",
                                        "--compile.backend", "aot_eager", *DEBUGMODEL, *SHORT),
                                    reference="single_debugmodel"),
    # Context-parallel layouts (each sequence split over the cp ranks), recording every parameter's gradient at step
    # 1. CP 2: 2 micro-batches of 4 accumulated, validating and saving every 2 steps (resumed below). CP 2 x FSDP 2 with
    # contiguous chunks, saving (test_context_parallel.py reshards it). CP 4 recomputing every block; CP 2 x TP 2
    # compiled (aot_eager); HSDP over cp with op-level selective AC; CP inside pipeline stages.
    "cp2": Run(2, (*CP2, "--training.local_batch_size", "4", *CHECKPOINTED, "--validation.enable", "--validation.freq",
                   "2", "--validation.steps", "2")),
    "cp2_fsdp2": Run(4, (*CP2, "--training.local_batch_size", "4", "--parallelism.context_parallel_load_balancer",
                         "none", *CHECKPOINTED)),
    "cp4": Run(4, ("--parallelism.context_parallel_degree", "4", "--training.local_batch_size", "8",
                   "--activation_checkpoint.mode", "full", *SHORT)),
    "cp2_tp2_compiled": Run(4, (*CP2, *TP2, "--training.local_batch_size", "8", "--compile.enable", "--compile.backend",
                                "aot_eager", *SHORT)),
    "hsdp2_cp2": Run(4, (*HSDP, *CP2, "--training.local_batch_size", "4", "--activation_checkpoint.mode", "selective",
                         "--activation_checkpoint.selective_ac_option", "op", *SHORT)),
    "pp2_cp2": Run(4, (*PP2, *CP2, "--training.local_batch_size", "8", *SHORT)),
    # Qwen3 (QK-norm, its own head size, grouped-query attention, tied embeddings) on every layout, pairwise: PP 2
    # (1F1B, 2 micro-batches of 4; the tied table on both stages, their gradients added) x TP 2 with loss parallel,
    # saving (resumed on the other layout below); HSDP 2 x CP 2 (FSDP over the cp ranks). Against one process of
    # Qwen3, which accumulates 4 micro-batches of 2.
    "qwen3_single": Run(1, (*QWEN3, *SHORT), reference=None, model="qwen3"),
    "pp2_tp2_qwen3": Run(4, (*QWEN3, *PP2, *TP2, "--training.local_batch_size", "8", *CHECKPOINTED, *SHORT),
                         reference="qwen3_single", model="qwen3"),
    "hsdp2_cp2_qwen3": Run(4, (*QWEN3, *HSDP, *CP2, "--training.local_batch_size", "4", *SHORT),
                           reference="qwen3_single", model="qwen3"),
}
# The rows that run every pair of options the runs above miss (pairs.py, test_pairs.py), each against the
# single-process run of its precision and float8 recipe, and the single-process runs of each half precision they are
# compared with; made in the same jobs as the shared runs of their size. They compare curves only: nothing recorded.
PAIR_RUNS = {name: Run(nproc, overrides, reference=pairs.reference(pairs.levels_of(nproc, overrides)), record=False)
             for name, (nproc, overrides) in pairs.generate([(r.nproc, r.argv) for r in SHARED_RUNS.values()]).items()}
REFERENCES = {name: Run(nproc, overrides, reference=None, record=False)
              for name, (nproc, overrides) in pairs.REFERENCES.items()}
# Document masking (block_causal) on every kind of layout, against its own single-process run (test_documents.py),
# 4 steps each, recording every parameter's gradient at step 1; in the jobs of the shared runs of their size.
MASKED_RUNS = {
    "masked_single": Run(1, (*MASKED, *SHORT), reference=None),  # 4 micro-batches of 2
    # TP 2 x FSDP 2, blocks compiled (aot_eager): 1 micro-batch of 4 per rank.
    "masked_tp2_fsdp2_compiled": Run(4, (*MASKED, *TP2, "--training.local_batch_size", "4", "--compile.enable",
                                         "--compile.backend", "aot_eager", *SHORT), reference="masked_single"),
    # PP 2 (1F1B, 2 micro-batches of 4: the documents reach the second stage beside its hidden states) x CP 2
    # (head-tail chunks under the mask).
    "masked_pp2_cp2": Run(4, (*MASKED, *PP2, *CP2, "--training.local_batch_size", "8", *SHORT),
                          reference="masked_single"),
}
# Mixture of experts (test_moe_layouts.py) on the data-parallel layouts, with and without expert parallelism, against
# its own single-process run, 4 steps each, recording every parameter's gradient and every token's experts at step 1:
# FSDP 4 without EP (the experts' 3-D weights sharded over the experts) and EP 4 (2 experts a rank; 2 micro-batches of
# 1 sequence, reduced after the last, FSDP prefetching a block ahead), both saving every 2 steps (resumed below);
# HSDP 2 x 2 with EP 2 recomputing every block, offloaded to the host; CP 2 x FSDP 2 with EP 2 over the cp ranks
# (head-tail chunks: each rank routes a quarter of each sequence's tokens), saving; TP 2 x FSDP 2 with EP 2 over the tp
# ranks (sequence parallel: each routes half of each sequence), saving, with op-level selective AC (its all-to-alls
# and reduce-scatters kept, the mixture's own FSDP units inside the block); TP 2 alone on 2 processes recomputing every
# block, accumulating 2 micro-batches (the mixture sharded over tp alone); PP 2 (1F1B, 2 micro-batches of 2, a block
# a stage: the first stage's auxiliary loss trained without the loss) x FSDP 2 with EP 2, saving; EP 2 on 2
# processes accumulating 2
# micro-batches, recomputing every other block. The single process accumulates 4.
# In bf16 (FSDP2's bf16 parameters against one process's autocast), EP 2 against one process, 2 steps (bf16 is this
# CPU's slowest), curves only: bf16's roundings differ between the two and flip routing decisions; it records its
# gradients, routes and dispatches for its twins, which must give its bits: the same run with op-level selective AC
# (test_moe_layouts.py) and, compiled, COMPILED_RUNS' (test_compile.py). Every run balances
# its experts by DeepSeek-V3's bias (training/expert_load.py), which steers routing from step 2 on.
MOE = (*MOE, *BALANCED)
EVERY_2 = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2")
OP_SAC = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
BF16 = ("--training.mixed_precision_param", "bfloat16")
# DeepSeek-V3's kind of mixture, trained with PaLM's z-loss on the logits (loss parallel's under TP) and ST-MoE's on the
# routers, at weights large enough for their gradients to show in every parameter's (test_moe_layouts.py), and with
# Megatron's expert capacity at factor 1 (each expert at most 22 of a 64-token sequence's slots; some sequences
# overflow at every step): its rows drop the same slots as one process on TP 2 x FSDP 2 x EP 2, where each tp rank
# holds half of each sequence, and on PP 2 x CP 2 x EP 2 (the Muon leg), head-tail chunks.
E6 = ("--moe.capacity_factor", "1", "--moe.num_experts", "6", "--moe.shared_experts", "1", "--moe.score_func",
      "sigmoid", "--training.z_loss", "1e-2", "--moe.router_z_loss", "1e-2")
MUON = ("--optimizer.name", "Muon")
MXFP8 = ("--float8.moe_fqns", "experts", "--float8.emulate")
MXFP8_HP = (*MXFP8, "--float8.moe_recipe_name", "mxfp8_wgrad_with_hp")
# With --model.name deepseek_v3: its auxiliary loss, the z-losses (E6's) and Muon on.
DEEPSEEK = ("--model.flavor", "debugmodel", "--moe.aux_loss_coeff", "1e-3", *E6[-4:], *MUON)
EVERY_STEP = ("--checkpoint.enable", "--checkpoint.interval", "1")
MOE_RUNS = {
    "moe_single": Run(1, (*MOE, *CHECKPOINTED, *SHORT), reference=None),
    "moe_fsdp4": Run(4, (*MOE, *CHECKPOINTED, *SHORT), reference="moe_single"),
    "moe_ep4": Run(4, (*MOE, *EP4, "--training.local_batch_size", "1", "--parallelism.fsdp_defer_grad_reduce",
                       "--parallelism.fsdp_prefetch", "1", *CHECKPOINTED, *SHORT), reference="moe_single"),
    "moe_hsdp2x2_ep2": Run(4, (*MOE, *HSDP, *EP2, "--activation_checkpoint.mode", "full",
                               "--parallelism.fsdp_cpu_offload", "--no-parallelism.fsdp_offload_pin_memory", *SHORT),
                           reference="moe_single"),
    "moe_ep2_cp2": Run(4, (*MOE, *CP2, *EP2, "--training.local_batch_size", "4", *CHECKPOINTED, *SHORT),
                       reference="moe_single"),
    "moe_ep2_tp2": Run(4, (*MOE, *TP2, *EP2, "--training.local_batch_size", "4", *OP_SAC, *CHECKPOINTED, *SHORT),
                       reference="moe_single"),
    "moe_tp2": Run(2, (*MOE, *TP2, "--training.local_batch_size", "4", "--activation_checkpoint.mode", "full",
                       *SHORT), reference="moe_single"),
    "moe_ep2_pp2": Run(4, (*MOE, *PP2, *EP2, "--training.local_batch_size", "4", *CHECKPOINTED, *SHORT),
                       reference="moe_single"),
    "moe_ep2": Run(2, (*MOE, *EP2, *EVERY_2, *SHORT), reference="moe_single"),
    # DeepSeek-V3's kind of mixture (E6): 6 experts, top 2, a shared expert, sigmoid scores, z-losses; on TP 2 x FSDP 2
    # x EP 2 each rank's 3 experts do not split over its 2 efsdp ranks, so FSDP shards their weights on dim 1
    # (parallelize.experts_dim); against one process of the same mixture.
    "moe_e6_single": Run(1, (*MOE, *E6, *SHORT), reference=None),
    "moe_e6_ep2_tp2": Run(4, (*MOE, *E6, *TP2, *EP2, "--training.local_batch_size", "4", *SHORT),
                          reference="moe_e6_single"),
    # The same mixture and layout trained by Muon (test_muon.py): its matrices (attention's, split on either dim by
    # TP; the shared expert's; the routed experts', split by EP and on dim 1 by FSDP) orthogonalized whole, saving
    # every step, against one process.
    "moe_e6_muon_single": Run(1, (*MOE, *E6, *MUON, *EVERY_STEP, *SHORT), reference=None),
    "moe_e6_muon_ep2_tp2": Run(4, (*MOE, *E6, *MUON, *TP2, *EP2, "--training.local_batch_size", "4", *EVERY_STEP,
                                   *SHORT), reference="moe_e6_muon_single"),
    # Qwen3-MoE's kind (16 fine-grained experts, top 4, renormalized, its auxiliary loss) on DDP 2 x TP 2 with EP 2
    # over the tp ranks: with Qwen3's dense runs, the model meets every layout (test_run_table.py); its mixture's
    # code is the one Llama's mixtures run on every layout above.
    "qwen3_moe_single": Run(1, (*QWEN3_MOE, *SHORT), reference=None, model="qwen3"),
    "qwen3_moe_ddp2_tp2_ep2": Run(4, (*QWEN3_MOE, *HSDP, *TP2, *EP2, "--training.local_batch_size", "4", *SHORT),
                                  reference="qwen3_moe_single", model="qwen3"),
    # DeepSeek-V3's debug model (MLA with a query latent, keys of 48 and values of 32; a dense block, then a mixture
    # of 8 experts in 4 groups, top 2 within the best 2, sigmoid, a shared expert, the selection bias, its
    # sequence-wise auxiliary loss and the z-losses on; one multi-token prediction module, a mixture block too),
    # trained by Muon: on PP 2 x TP 2 with EP 2 over the tp ranks (MLA's latents replicated on both, its heads split;
    # 1F1B, 2 micro-batches of 4; the MTP module on the last stage with the embedding table the first shares) and on
    # HSDP 2 x CP 2 with EP 2 over the cp ranks (head-tail chunks of keys and values of unequal head sizes; MTP's
    # targets shifted before the cut; Muon's matrices gathered over replicas and shards), against one process: with
    # these the model meets every layout.
    "deepseek_single": Run(1, (*DEEPSEEK, *SHORT), reference=None, model="deepseek_v3"),
    "deepseek_pp2_tp2_ep2": Run(4, (*DEEPSEEK, *PP2, *TP2, *EP2, "--training.local_batch_size", "8", *SHORT),
                                reference="deepseek_single", model="deepseek_v3"),
    "deepseek_hsdp2_cp2_ep2": Run(4, (*DEEPSEEK, *HSDP, *CP2, *EP2, "--training.local_batch_size", "4", *SHORT),
                                  reference="deepseek_single", model="deepseek_v3"),
    # The routed experts in MXFP8 (quantization/mxfp8_experts.py, emulated), each against one process of its recipe
    # training the global batch as one micro-batch of 8: EP 2 over FSDP 2 (a micro-batch of 4 a rank, every block
    # recomputed), whose experts compute both ranks' slots together in one process's order, so every scale is one
    # process's, the weight gradients' blocks of 32 slots too; mxfp8_wgrad_with_hp on TP 2 with EP 2 over the tp ranks
    # (each routes half of every sequence: refused with mxfp8's weight gradients), whose scales are per slot or weight.
    "moe_mxfp8_single": Run(1, (*MOE, *MXFP8, "--training.local_batch_size", "8", *SHORT), reference=None),
    "moe_mxfp8_ep2": Run(2, (*MOE, *MXFP8, *EP2, "--training.local_batch_size", "4", "--activation_checkpoint.mode",
                             "full", *SHORT), reference="moe_mxfp8_single"),
    "moe_mxfp8_hp_single": Run(1, (*MOE, *MXFP8_HP, "--training.local_batch_size", "8", *SHORT), reference=None),
    "moe_mxfp8_hp_ep2_tp2": Run(2, (*MOE, *MXFP8_HP, *TP2, *EP2, "--training.local_batch_size", "8", *SHORT),
                                reference="moe_mxfp8_hp_single"),
    "moe_single_bf16": Run(1, (*MOE, *BF16, "--training.steps", "2"), reference=None, record=False),
    "moe_ep2_bf16": Run(2, (*MOE, *EP2, *BF16, "--training.steps", "2"), reference="moe_single_bf16"),
    "moe_ep2_bf16_op_sac": Run(2, (*MOE, *EP2, *BF16, *OP_SAC, "--training.steps", "2"), reference="moe_single_bf16"),
}
# test_compile.py's layouts, each block compiled, in the job of the shared runs of their size: TP 2 by inductor, every
# block recomputed, 4 steps validating every 2 (step 4 repeats step 2's work, which must build no graph), on 2
# processes: each rank compiles and builds its C++ kernels itself, cold on CI, and dynamo never traces FSDP's hooks
# (torch marks them disabled to it), so FSDP 2 beside it would show nothing more for two more ranks' compiles; FSDP 4
# with every other block recomputed and HSDP 2 x 2 with op-level selective AC and bf16, by aot_eager, one step each
# (their gradients are the point, against the single-process eager run's); and EP 2 in bf16 with op-level selective
# AC, by aot_eager in pieces around the dispatch (parallel/compile.py), 2 steps, against its eager twin without AC
# (MOE_RUNS' moe_ep2_bf16, whose bits it must give).
AOT, ONE_STEP = ("--compile.enable", "--compile.backend", "aot_eager"), ("--training.steps", "1")
COMPILED_RUNS = {
    "tp2_inductor": Run(2, (*TP2, "--training.local_batch_size", "4", "--activation_checkpoint.mode", "full",
                            "--compile.enable", "--compile.backend", "inductor", "--validation.enable",
                            "--validation.freq", "2", "--validation.steps", "1", *SHORT)),
    "fsdp4_ac_every_2_compiled": Run(4, ("--activation_checkpoint.mode", "selective",
                                         "--activation_checkpoint.selective_ac_option", "2", *AOT, *ONE_STEP)),
    "hsdp_op_sac_bf16_compiled": Run(4, (*HSDP, "--activation_checkpoint.mode", "selective",
                                         "--activation_checkpoint.selective_ac_option", "op",
                                         "--training.mixed_precision_param", "bfloat16", *AOT, *ONE_STEP)),
    "moe_ep2_bf16_compiled": Run(2, (*MOE, *EP2, *BF16, *OP_SAC, *AOT, "--training.steps", "2"),
                                 reference="moe_single_bf16"),
}
# Float8 (test_float8.py): each layout against the single-process float8 run of its recipe, every micro-batch 2
# sequences as there (a tensorwise scale is the max of a whole micro-batch's activations), recording every parameter's
# gradient and every float8 scale at step 1. The references train 4 steps, as many as the longest layout, and are
# compared with the first 4 of "single"'s fp32 curve too; the all-gather run trains 4 (it is resumed), the other
# layouts 2: step 2 is the first whose weights and precomputed scales came out of an update, and emulated float8 under
# TP is the suite's slowest step.
ALL_GATHER, PRECOMPUTE = "--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"
ROWWISE, TWO = ("--float8.recipe_name", "rowwise"), ("--training.steps", "2")
FLOAT8_RUNS = {
    "float8_single": Run(1, (*FLOAT8, *SHORT), reference=None),
    "float8_rowwise_single": Run(1, (*FLOAT8, *ROWWISE, *SHORT), reference=None),
    # Weights gathered in float8, each weight's max all-reduced before its gather; saving every 2 steps (resumed).
    "float8_fsdp4_ag": Run(4, (*FLOAT8, ALL_GATHER, *CHECKPOINTED, *SHORT), reference="float8_single"),
    # Weights gathered in fp32 and cast after: the same numbers as the all-gather run's, bitwise, which is all that
    # is compared (no gradients recorded).
    "float8_fsdp4": Run(4, (*FLOAT8, *TWO), reference="float8_single", record=False),
    "float8_pp2_fsdp2": Run(4, (*FLOAT8, *PP2, "--training.local_batch_size", "4", *TWO),  # 1F1B, 2 micro-batches
                            reference="float8_single"),
    # torchao's float8 TP styles, which gather activations in float8; every weight's scale from one all-reduce after
    # each optimizer step. 2 micro-batches a rank.
    "float8_tp2_fsdp2_ag_pre": Run(4, (*FLOAT8, *TP2, "--training.local_batch_size", "2", ALL_GATHER, PRECOMPUTE,
                                       *TWO), reference="float8_single"),
    "float8_rowwise_tp2_fsdp2": Run(4, (*FLOAT8, *ROWWISE, *TP2, "--training.local_batch_size", "2", *TWO),
                                    reference="float8_rowwise_single"),
}
# The single-process run of the layouts of 4 pipeline stages, which train the debug model's 6 blocks, 4 steps as they.
SINGLES = {"single_debugmodel": Run(1, (*DEBUGMODEL, *SHORT), reference=None)}
ALL_RUNS = {**SHARED_RUNS, **PAIR_RUNS, **REFERENCES, **MASKED_RUNS, **MOE_RUNS, **COMPILED_RUNS, **FLOAT8_RUNS,
            **SINGLES, **INVARIANT_RUNS}  # INVARIANT_RUNS: training.layout_invariant's (invariant_runs.py)

PIPELINED, CONTEXT_PARALLEL = of_kind(SHARED_RUNS, "pipelined"), of_kind(SHARED_RUNS, "context_parallel")
COMPILED = of_kind(SHARED_RUNS, "compiled")
# A run stopped after a step and resumed to STEPS (or as far as its overrides say).
RESUMED_RUNS = {
    # Saving asynchronously, with a half-written-looking step-99 in the way (HALF_WRITTEN; test_checkpoint.py).
    "fsdp4_resumed": Resumed("fsdp4", 4, 4, (*CHECKPOINTED, "--checkpoint.async_mode", "async")),
    # Validating at steps 6 and 8, keeping the newest 2 checkpoints: steps 7 and 8 still the straight run's, bitwise.
    "tp2_fsdp2_resumed": Resumed("tp2_fsdp2", 4, 4, (*TP2_FSDP2, "--checkpoint.keep_latest_k", "2",
                                                     "--validation.enable", "--validation.freq", "2",
                                                     "--validation.steps", "2")),
    # Saving asynchronously and keeping the newest 2 (test_pipeline.py).
    "pp2_gpipe_resumed": Resumed("pp2_gpipe", 4, 2, (*SHARED_RUNS["pp2_gpipe"].overrides, "--checkpoint.async_mode",
                                                     "async", "--checkpoint.keep_latest_k", "2")),
    "cp2_resumed": Resumed("cp2", 6, 2, SHARED_RUNS["cp2"].overrides),
    # Recording its graph counts.
    "tp2_compiled_resumed": Resumed("tp2_compiled", 2, 2, SHARED_RUNS["tp2_compiled"].overrides, record=True),
    # The experts' sharded 3-D weights and their AdamW moments, saved without EP and loaded on EP 2, saved on EP 4
    # and loaded on FSDP 2 without EP.
    "moe_fsdp4_on_ep2": Resumed("moe_fsdp4", 2, 2, (*MOE, *EP2, *SHORT)),
    "moe_ep4_on_fsdp2": Resumed("moe_ep4", 2, 2, (*MOE, *SHORT)),
    # Saved on TP 2 x FSDP 2 x EP 2, loaded on EP 4 without TP (1 sequence a micro-batch): with the two above, EP 2
    # -> EP 4 -> no EP.
    "moe_ep2_tp2_on_ep4": Resumed("moe_ep2_tp2", 2, 4, (*MOE, *EP4, "--training.local_batch_size", "1", *SHORT)),
    # Muon's state (each matrix's momentum, the AdamW groups' moments), saved on TP 2 x FSDP 2 x EP 2 and loaded on
    # PP 2 x CP 2 x EP 2 (1F1B, 2 micro-batches of 4; the experts over the cp ranks), with its shards offloaded to the
    # host and every block recomputed: the layouts the straight run lacks, checked against one process
    # (test_muon.py; HSDP's replicas are the DeepSeek-V3 rows', which train by Muon).
    "moe_e6_muon_on_pp2_cp2": Resumed("moe_e6_muon_ep2_tp2", 2, 4, (
        *MOE, *E6, *MUON, *PP2, *CP2, *EP2, "--training.local_batch_size", "8", "--activation_checkpoint.mode", "full",
        "--parallelism.fsdp_cpu_offload", "--no-parallelism.fsdp_offload_pin_memory", *CHECKPOINTED, *SHORT)),
    # Qwen3's tied table, saved by PP 2 x TP 2 (held by both stages) and loaded on HSDP 2 x CP 2.
    "pp2_tp2_qwen3_on_hsdp2_cp2": Resumed("pp2_tp2_qwen3", 2, 4, (*SHARED_RUNS["hsdp2_cp2_qwen3"].overrides,
                                                                  *CHECKPOINTED), model="qwen3"),
    **INVARIANT_RESUMED,  # training.layout_invariant's (invariant_runs.py)
    # Float8 weights in FSDP's state: a DTensor of torchao's float8-casting subclass, saved and loaded by DCP.
    "float8_fsdp4_ag_resumed": Resumed("float8_fsdp4_ag", 2, 4, FLOAT8_RUNS["float8_fsdp4_ag"].overrides),
}
HALF_WRITTEN = {"fsdp4_resumed": 99}  # resumed run -> the step of a checkpoint folder without .metadata put there
# The resharding legs (test_checkpoint.py, test_pipeline.py, test_context_parallel.py), in the job of the 4-process
# resumed runs, each a shared run's step 4 resumed on another layout to step 6, saving every 2 steps; "hsdp2x2"
# starts from FSDP 4's through initial_load_path instead of a copy.
LEG = (*CHECKPOINTED, "--training.steps", "6")
RESHARD_LEGS = {"tp2_fsdp2": Resumed("fsdp4", 4, 4, (*LEG, *TP2)),
                "hsdp2x2": Resumed("fsdp4", 4, 4, (*LEG, *HSDP), initial_load=True),
                "pp_to_fsdp4": Resumed("pp2_fsdp2", 4, 4, LEG), "cp_to_fsdp4": Resumed("cp2_fsdp2", 4, 4, LEG)}
# Then these go on in their folder on their first layout to step 8 (their step-6 checkpoints stay).
RESHARD_BACK = {"pp_to_fsdp4": "pp2_fsdp2", "cp_to_fsdp4": "cp2_fsdp2"}
