"""Parallelism, applied from outside the model: the layout and its mesh (dims.py), the plan that applies TP,
activation checkpointing, compile and FSDP in one order (parallelize.py), pipeline stages and schedules
(pipeline.py), and context parallelism (context_parallel.py).

Imports the layers below (config, runtime, models, data); checkpointing and training build on it.
"""
