"""training.layout_invariant's shared runs (test_layout_invariant.py), which run_table.py joins to the suite's."""

from launch import BALANCED, CHECKPOINTED, CP2, DEBUGMODEL, EP2, HSDP, MOE, PP2, TP2
from run_spec import SHORT, Resumed, Run

# training.layout_invariant (test_layout_invariant.py): each layout bitwise equal to its single-process run, the loss
# and grad norm of every step and every tensor it saved (weights, AdamW's moments, every 2 steps). A global batch of 12
# micro-batches of 1 sequence: 3 micro-steps on FSDP 4 and HSDP 2 x 2 (a count no power of two), 6 on DDP 2 and FSDP 2
# (recomputing every block). 2 steps (the second the first after an update), FSDP 4 and one process 4: FSDP 4's is
# resumed on DDP 2 after step 2. The mixture (z-loss, bias balancing; 8 micro-batches) records its routes and
# gradients at step 1.
INVARIANT = ("--training.layout_invariant", "--training.global_batch_size", "12", "--training.local_batch_size", "1",
             *CHECKPOINTED, *SHORT)
TWO_STEPS = ("--training.steps", "2")
DDP2 = ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1")
MOE_INVARIANT = (*INVARIANT, *MOE, *BALANCED, "--training.z_loss", "1e-4", "--training.global_batch_size", "8", *TWO_STEPS)
PIPELINE_4 = ("--training.local_batch_size", "4", "--parallelism.pipeline_parallel_microbatches", "4")
GLOBAL_4 = ("--training.global_batch_size", "4")
CP_INVARIANT = (*INVARIANT, "--training.layout_invariant_cp", "2", "--training.global_batch_size", "4",
                "--training.local_batch_size", "2", *TWO_STEPS)
INVARIANT_RUNS = {
    "inv_single": Run(1, INVARIANT, reference=None, record=False),
    "inv_fsdp4": Run(4, INVARIANT, reference="inv_single", record=False),
    "inv_hsdp2x2": Run(4, (*INVARIANT, *HSDP, *TWO_STEPS), reference="inv_single", record=False),
    "inv_ddp2": Run(2, (*INVARIANT, *DDP2, *TWO_STEPS), reference="inv_single", record=False),
    "inv_fsdp2_ac": Run(2, (*INVARIANT, "--activation_checkpoint.mode", "full", *TWO_STEPS),
                        reference="inv_single", record=False),
    # TP 2 with sequence and loss parallel (12 micro-steps), and beside FSDP 2 (6): the others compute in its blocks.
    "inv_tp2": Run(2, (*INVARIANT, *TP2, *TWO_STEPS), reference="inv_single", record=False),
    "inv_tp2_fsdp2": Run(4, (*INVARIANT, *TP2, *TWO_STEPS), reference="inv_single", record=False),
    "inv_moe_single": Run(1, MOE_INVARIANT, reference=None),
    # FSDP 4 with EP 2: each expert's slots of 2 ranks computed apart, summed, then over efsdp by FSDP.
    "inv_moe_fsdp4_ep2": Run(4, (*MOE_INVARIANT, *EP2), reference="inv_moe_single"),
    # Pipelines: GPipe, 3 local batches of 4 micro-batches; 1F1B, 2 of 6, every block recomputed.
    "inv_pp2_gpipe": Run(2, (*INVARIANT, *PP2, "--parallelism.pipeline_parallel_schedule", "GPipe",
                             *PIPELINE_4, *TWO_STEPS), reference="inv_single", record=False),
    "inv_pp2_1f1b": Run(2, (*INVARIANT, *PP2, "--training.local_batch_size", "6",
                            "--parallelism.pipeline_parallel_microbatches", "6", "--activation_checkpoint.mode",
                            "full", *TWO_STEPS), reference="inv_single", record=False),
    # Beside FSDP 2 (1F1B): 3 local batches of 2 micro-batches a rank, each micro-batch's gradients reduced alone.
    "inv_pp2_fsdp2": Run(4, (*INVARIANT, *PP2, "--training.local_batch_size", "2", *TWO_STEPS),
                         reference="inv_single", record=False),
    # 4 stages of the debug model's 6 blocks, 2 a rank, against its own single process (4 micro-batches of 1):
    # Interleaved1F1B, 1 local batch of 4 micro-batches; LoopedBFS, 2 of 2.
    "inv_debug_single": Run(1, (*INVARIANT, *DEBUGMODEL, *GLOBAL_4, *TWO_STEPS), reference=None, record=False),
    "inv_pp2_interleaved": Run(2, (*INVARIANT, *DEBUGMODEL, *GLOBAL_4, *PP2, "--parallelism.pipeline_parallel_schedule",
                                   "Interleaved1F1B", *PIPELINE_4, *TWO_STEPS), reference="inv_debug_single",
                                record=False),
    "inv_pp2_looped_bfs": Run(2, (*INVARIANT, *DEBUGMODEL, *GLOBAL_4, *PP2, "--parallelism.pipeline_parallel_schedule",
                                  "LoopedBFS", "--training.local_batch_size", "2", *TWO_STEPS),
                              reference="inv_debug_single", record=False),
    # CP 2, each rank's queries against every key in one call, against one process computing in CP 2's token halves
    # (training.layout_invariant_cp 2): 2 micro-steps of 2 sequences, few of CP's many small collectives.
    "inv_cp_single": Run(1, CP_INVARIANT, reference=None, record=False),
    "inv_cp2": Run(2, (*CP_INVARIANT, *CP2), reference="inv_cp_single", record=False),
    # The halves beside data parallelism (1 micro-step a rank): CP 2 x FSDP 2 (FSDP's tree over dp_shard x cp), and
    # FSDP 2 and DDP 2 computing in the halves.
    "inv_cp2_fsdp2": Run(4, (*CP_INVARIANT, *CP2), reference="inv_cp_single", record=False),
    "inv_cp_fsdp2": Run(2, CP_INVARIANT, reference="inv_cp_single", record=False),
    "inv_cp_ddp2": Run(2, (*CP_INVARIANT, *DDP2), reference="inv_cp_single", record=False),
}
# FSDP 4's step 2 resumed on DDP 2, bitwise the single process's steps 3 and 4.
INVARIANT_RESUMED = {"inv_fsdp4_on_ddp2": Resumed("inv_fsdp4", 2, 2, (*INVARIANT, *DDP2))}
