"""The process around the training math: process group and timeouts (process.py), one error line per job
(errors.py), preemption signals (signals.py), the numerics of the update (precision.py), throughput and the metric
logger (metrics.py), and what a run does with the history it finds in its dump folder (run_history.py).

Imports config only: models, data and parallelism use the runtime, never the other way round.
"""
