"""Parallelism, applied from outside the model.
- dims.py: the layout: degrees, their validation, and the device mesh
- parallelize.py: the plan that applies TP, CP, EP, activation checkpointing, compile and FSDP in one order
- pipeline.py: pipeline stages of whole blocks, and the schedules that run them
- stage_ties.py: a parameter the first and last stages share (tied embeddings): their gradients added
- context_parallel.py: each sequence split across the cp ranks, keys and values all-gathered per block
- expert_parallel.py: a mixture of experts' routed experts split across ranks, tokens sent to them by all-to-all
- compile.py: torch.compile of each block, whole, or in pieces around expert parallelism's dispatch
- selective_ac.py: what op-level activation checkpointing keeps, and its count of ops that FSDP's hooks skip
- sequence_slots.py: a sequence split across ranks: the slots other ranks hold at earlier positions (expert capacity)
- ordered_reduce.py: sums in one fixed order, the canonical tree; FSDP's reduce-scatter in that order
- tp_blocks.py: TP 2's order of sums on a layout without TP: the TP plan's styles, computed in 2 blocks
- cp_blocks.py: CP 2's order of sums on a layout without CP: its two ranks' token halves, stacked on the batch dim

Imports the layers below (config, runtime, models, data); checkpointing and training build on it.
"""
