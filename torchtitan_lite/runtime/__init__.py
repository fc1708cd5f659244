"""The process around the training math.
- process.py: ranks, device, process group and timeouts, threads, determinism
- errors.py: one error line per job, whichever rank fails first
- signals.py: preemption signals and a vanished launcher: the run ends at a step boundary, with a checkpoint
- startup_interrupt.py: Ctrl-C before the first step stops the job in one line, whenever it came
- precision.py: the numerics of the update: dtypes, fp16 loss scaling, steps whose gradients are not finite
- metrics.py: throughput accounting: FLOPs, the peak MFU is against, memory
- metric_logger.py: the metric logger: console, metrics.jsonl, TensorBoard, W&B
- run_history.py: what a run does with the history it finds in its dump folder, and how metrics.jsonl is read
- run_lock.py: one live run per dump folder
- flight_recorder.py: a hang that names its cause: the rank that did not join, the collective, the point of the step
- profiling.py: torch.profiler traces of chosen steps, with the step's phases named in them
- phases.py: a phase of the step named once, for the profiler's trace and for a hang's error line
- memory_snapshot.py: GPU memory snapshots, and the one line a step out of memory ends with
- stragglers.py: which rank holds the others up, against the median rank at every logging step
- throughput.py: tokens/s and MFU between two logging steps, validation left out
- memory_use.py: a logged record's memory fields: the peak, the state held after the first step, the GPU allocator's
- wandb_run.py: Weights & Biases beside metrics.jsonl, a resumed job continuing the same run
- replica_launcher.py: run_train.sh's REPLICA_GROUPS mode: the lighthouse and a torchrun per replica group, each
  started again when it fails
- lighthouse.py: torchft's lighthouse kept alive on its port, and started in 0.1 s (its Rust main alone)
- torchrun_output.py: a replica group's torchrun output without torchrun's report of a failed worker
- fence.py: which replica group may write the run's folder: a claim in metrics.jsonl that a frozen writer finds taken
- watchdog.py: a bound on a stretch of the training thread: a replica group hung while alive leaves the run

Imports config only: models, data and parallelism use the runtime, never the other way round.
"""
