"""The suite's shared runs, by name: what each trains (processes and train.py overrides beside launch.COMMON), which
record their gradients, what each is compared with, and which are resumed or resharded. conftest.py makes them
(SharedRuns), the tests import these tables to parametrize over them: a plain module, imported once, so the pair
rows are generated once per session."""

from launch import CHECKPOINTED, CP2, DEBUGMODEL, FLOAT8, HSDP, MASKED, PP2, PROFILED, TP2, TP2_FSDP2
from pairs import REFERENCES, generate

SHORT = ("--training.steps", "4")  # after STEPS on the command line, so it wins
# name -> (processes, overrides), all with global batch 8. One process and DDP accumulate; the 4-process layouts take
# one micro-batch per rank (under TP each costs ~8 collectives per block; test_checkpoint.py accumulates on TP 2 x 2).
SHARED_RUNS = {
    "single": (1, ()),  # 4 micro-batches of 2
    # 1 of 2 per rank; traced at steps 4 and 8 (test_profiling.py: profiling changes no number the others read).
    "fsdp4": (4, (*CHECKPOINTED, *PROFILED)),
    # 1 of 4 per rank, each block recomputed in backward: AC leaves the numerics alone (the TP 2 x FSDP 2 reshard leg
    # of test_checkpoint.py runs without it).
    "tp2_fsdp2": (4, TP2_FSDP2),
    # Read by the layout test alone, which compares the steps both runs have: 4 show parity as well as 8.
    "tp4": (4, ("--parallelism.tensor_parallel_degree", "4", "--training.local_batch_size", "8", *SHORT)),  # 1 of 8
    "hsdp2x2": (4, (*HSDP, *SHORT)),  # 1 of 2 per rank
    # DDP is FSDP2 on a (replicate, shard = 1) mesh; 2 replicas show it as well as 4. 2 micro-batches of 2 per rank.
    "ddp2": (2, ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                 *SHORT)),
    # Pipeline layouts, one per schedule, recording every parameter's gradient at step 1 (grad_dump.py). GPipe: 2
    # local batches of 4 accumulated, 2 micro-batches each; 1F1B beside FSDP, validating and saving every 2 steps.
    # FSDP2's options (test_fsdp_options.py). hpZ over pairs of the 4 shards, two blocks prefetched each way, and 2
    # micro-batches of 1 per rank reduced once after the last; the output and input casts are fp32 here, so they are
    # only shown to run. Then parameters, gradients and AdamW's state in host memory (the device is the host here).
    "fsdp4_hpz_prefetch_deferred_reduce": (4, (
        "--parallelism.fsdp_reshard_after_forward", "2", "--parallelism.fsdp_prefetch", "2",
        "--training.local_batch_size", "1", "--parallelism.fsdp_defer_grad_reduce",
        "--training.mixed_precision_output", "float32", "--no-training.mixed_precision_cast_forward_inputs", *SHORT)),
    "fsdp4_offload_reshard_always": (4, (
        "--parallelism.fsdp_cpu_offload", "--no-parallelism.fsdp_offload_pin_memory",
        "--parallelism.fsdp_reshard_after_forward", "always", *SHORT)),
    # TP 2 compiled (aot_eager), validating and saving every 2 steps: test_compile.py resumes it.
    "tp2_compiled": (2, (*TP2, "--training.local_batch_size", "4", "--compile.enable", "--compile.backend", "aot_eager",
                         *CHECKPOINTED, "--validation.enable", "--validation.freq", "2", "--validation.steps", "1",
                         "--training.steps", "6")),
    "pp2_gpipe": (2, (*PP2, "--parallelism.pipeline_parallel_schedule", "GPipe", "--training.local_batch_size", "4",
                      *CHECKPOINTED)),
    "pp2_fsdp2": (4, (*PP2, "--training.local_batch_size", "4", *CHECKPOINTED, "--validation.enable",
                      "--validation.freq", "2", "--validation.steps", "2")),
    # 4 stages of the debug model's 6 blocks (1, 2, 2, 1: the end ones hold the embedding and the output), 2 per rank,
    # 4 micro-batches of 2, every block recomputed in backward; interleaved with blocks compiled (aot_eager).
    "pp2_tp2_looped_bfs": (4, (*PP2, *TP2, "--parallelism.pipeline_parallel_schedule", "LoopedBFS",
                               "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_microbatches", "4",
                               "--activation_checkpoint.mode", "full", *DEBUGMODEL, *SHORT)),
    "pp2_interleaved_compiled": (2, (*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                     "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_microbatches",
                                     "4", "--compile.enable", "--compile.backend", "aot_eager", *DEBUGMODEL, *SHORT)),
    # Context-parallel layouts (each sequence split over the cp ranks), recording every parameter's gradient at step
    # 1. CP 2: 2 micro-batches of 4 accumulated, validating and saving every 2 steps (resumed below). CP 2 x FSDP 2 with
    # contiguous chunks, saving (test_context_parallel.py reshards it). CP 4 recomputing every block; CP 2 x TP 2
    # compiled (aot_eager); HSDP over cp with op-level selective AC; CP inside pipeline stages.
    "cp2": (2, (*CP2, "--training.local_batch_size", "4", *CHECKPOINTED, "--validation.enable", "--validation.freq",
                "2", "--validation.steps", "2")),
    "cp2_fsdp2": (4, (*CP2, "--training.local_batch_size", "4", "--parallelism.context_parallel_load_balancer", "none",
                      *CHECKPOINTED)),
    "cp4": (4, ("--parallelism.context_parallel_degree", "4", "--training.local_batch_size", "8",
                "--activation_checkpoint.mode", "full", *SHORT)),
    "cp2_tp2_compiled": (4, (*CP2, *TP2, "--training.local_batch_size", "8", "--compile.enable", "--compile.backend",
                             "aot_eager", *SHORT)),
    "hsdp2_cp2": (4, (*HSDP, *CP2, "--training.local_batch_size", "4", "--activation_checkpoint.mode", "selective",
                      "--activation_checkpoint.selective_ac_option", "op", *SHORT)),
    "pp2_cp2": (4, (*PP2, *CP2, "--training.local_batch_size", "8", *SHORT)),
}
# The rows that run every pair of options the runs above miss (pairs.py, test_pairs.py), and the single-process
# runs of each half precision they are compared with; made in the same jobs as the shared runs of their size.
PAIR_RUNS = generate(SHARED_RUNS)
# Document masking (block_causal) on every kind of layout, against its own single-process run (test_documents.py),
# 4 steps each, recording every parameter's gradient at step 1; in the jobs of the shared runs of their size.
MASKED_RUNS = {
    "masked_single": (1, (*MASKED, *SHORT)),  # 4 micro-batches of 2
    # TP 2 x FSDP 2, blocks compiled (aot_eager): 1 micro-batch of 4 per rank.
    "masked_tp2_fsdp2_compiled": (4, (*MASKED, *TP2, "--training.local_batch_size", "4", "--compile.enable",
                                      "--compile.backend", "aot_eager", *SHORT)),
    # PP 2 (1F1B, 2 micro-batches of 4: the documents reach the second stage beside its hidden states) x CP 2
    # (head-tail chunks under the mask).
    "masked_pp2_cp2": (4, (*MASKED, *PP2, *CP2, "--training.local_batch_size", "8", *SHORT)),
}
# test_compile.py's 4-process layouts, each block compiled, in the job of the shared runs of their size: TP 2 x FSDP 2
# (the shared run's settings) by inductor, 4 steps validating every 2 (step 4 repeats step 2's work, which must build
# no graph); FSDP 4 with every other block recomputed and HSDP 2 x 2 with op-level selective AC and bf16, by
# aot_eager, one step each (their gradients are the point).
AOT, ONE_STEP = ("--compile.enable", "--compile.backend", "aot_eager"), ("--training.steps", "1")
COMPILED_RUNS = {
    "tp2_fsdp2_inductor": (4, (*TP2_FSDP2, "--compile.enable", "--compile.backend", "inductor", "--validation.enable",
                               "--validation.freq", "2", "--validation.steps", "1", *SHORT)),
    "fsdp4_ac_every_2_compiled": (4, ("--activation_checkpoint.mode", "selective",
                                      "--activation_checkpoint.selective_ac_option", "2", *AOT, *ONE_STEP)),
    "hsdp_op_sac_bf16_compiled": (4, (*HSDP, "--activation_checkpoint.mode", "selective",
                                      "--activation_checkpoint.selective_ac_option", "op",
                                      "--training.mixed_precision_param", "bfloat16", *AOT, *ONE_STEP)),
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
    "float8_single": (1, (*FLOAT8, *SHORT)),
    "float8_rowwise_single": (1, (*FLOAT8, *ROWWISE, *SHORT)),
    # Weights gathered in float8, each weight's max all-reduced before its gather; saving every 2 steps (resumed).
    "float8_fsdp4_ag": (4, (*FLOAT8, ALL_GATHER, *CHECKPOINTED, *SHORT)),
    "float8_fsdp4": (4, (*FLOAT8, *TWO)),  # weights gathered in fp32 and cast after: the same numbers, bitwise
    "float8_pp2_fsdp2": (4, (*FLOAT8, *PP2, "--training.local_batch_size", "4", *TWO)),  # 1F1B, 2 micro-batches
    # torchao's float8 TP styles, which gather activations in float8; every weight's scale from one all-reduce after
    # each optimizer step. 2 micro-batches a rank.
    "float8_tp2_fsdp2_ag_pre": (4, (*FLOAT8, *TP2, "--training.local_batch_size", "2", ALL_GATHER, PRECOMPUTE,
                                    *TWO)),
    "float8_rowwise_tp2_fsdp2": (4, (*FLOAT8, *ROWWISE, *TP2, "--training.local_batch_size", "2", *TWO)),
}
# The single-process run of the layouts of 4 pipeline stages, which train the debug model's 6 blocks, 4 steps as they.
SINGLES = {"single_debugmodel": (1, (*DEBUGMODEL, *SHORT))}
ALL_RUNS = {**SHARED_RUNS, **PAIR_RUNS, **REFERENCES, **MASKED_RUNS, **COMPILED_RUNS, **FLOAT8_RUNS, **SINGLES}
RECORDED = [*SHARED_RUNS, *SINGLES, "tp2_compiled_resumed", *MASKED_RUNS, *COMPILED_RUNS,
            *(n for n in FLOAT8_RUNS if n != "float8_fsdp4")]
# The single-process run each run of SHARED_RUNS and COMPILED_RUNS is compared with.
SINGLE_OF = {name: "single_debugmodel" if "debugmodel" in overrides else "single"
             for name, (_, overrides) in {**SHARED_RUNS, **COMPILED_RUNS}.items()}

PIPELINED = [name for name in SHARED_RUNS if name.startswith("pp")]
CONTEXT_PARALLEL = [name for name in SHARED_RUNS if "cp" in name]
# name -> (run, step it resumes after, processes, overrides): a run stopped after that step and resumed to STEPS.
# The resumed runs of one size are made in one job of their own, after the shared runs': none shares a process with
# the run it resumes, so a resume proves what the checkpoint holds, not what a process still held.
RESUMED_RUNS = {
    # Saving asynchronously, with a half-written-looking step-99 in the way (HALF_WRITTEN; test_checkpoint.py).
    "fsdp4_resumed": ("fsdp4", 4, 4, (*CHECKPOINTED, "--checkpoint.async_mode", "async")),
    # Validating at steps 6 and 8, keeping the newest 2 checkpoints: steps 7 and 8 still the straight run's, bitwise.
    "tp2_fsdp2_resumed": ("tp2_fsdp2", 4, 4, (*TP2_FSDP2, "--checkpoint.keep_latest_k", "2", "--validation.enable",
                                              "--validation.freq", "2", "--validation.steps", "2")),
    # Saving asynchronously and keeping the newest 2 (test_pipeline.py).
    "pp2_gpipe_resumed": ("pp2_gpipe", 4, 2, (*SHARED_RUNS["pp2_gpipe"][1], "--checkpoint.async_mode", "async",
                                              "--checkpoint.keep_latest_k", "2")),
    "cp2_resumed": ("cp2", 6, 2, SHARED_RUNS["cp2"][1]),
    "tp2_compiled_resumed": ("tp2_compiled", 2, 2, SHARED_RUNS["tp2_compiled"][1]),  # recording its graph counts
    # Float8 weights in FSDP's state: a DTensor of torchao's float8-casting subclass, saved and loaded by DCP.
    "float8_fsdp4_ag_resumed": ("float8_fsdp4_ag", 2, 4, FLOAT8_RUNS["float8_fsdp4_ag"][1]),
}
HALF_WRITTEN = {"fsdp4_resumed": 99}  # resumed run -> the step of a checkpoint folder without .metadata put there
# The resharding legs (test_checkpoint.py, test_pipeline.py, test_context_parallel.py), in the job of the 4-process
# resumed runs, each a shared run's step 4 resumed on another layout to step 6, saving every 2 steps: name -> (the run
# whose step-4 checkpoint is copied in, overrides); "hsdp2x2" starts from FSDP 4's through initial_load_path instead.
RESHARD_LEGS = {"tp2_fsdp2": ("fsdp4", TP2), "hsdp2x2": (None, HSDP), "pp_to_fsdp4": ("pp2_fsdp2", ()),
                "cp_to_fsdp4": ("cp2_fsdp2", ())}
# Then these go on in their folder on their first layout to step 8 (their step-6 checkpoints stay).
RESHARD_BACK = {"pp_to_fsdp4": "pp2_fsdp2", "cp_to_fsdp4": "cp2_fsdp2"}
