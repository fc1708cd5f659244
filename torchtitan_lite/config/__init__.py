"""The run's configuration. The bottom layer: it imports nothing else of the package, and every layer reads it.
- sections.py: the sections and their options, each written once (default, help, choices, rule)
- job_config.py: loading TOML, `--section.key` overrides, `--help`, and the checks of every value
- rules.py: the values an option accepts beyond its type, in the words a user reads and the test behind them
- paths.py: where a relative path resolves (the caller's directory, for the command line's), and the cache folder

The one package that re-exports: `from torchtitan_lite.config import JobConfig` is how every layer names its config.
"""

from torchtitan_lite.config.job_config import (OPTIONS, SECTIONS, TABLES, did_you_mean, help_text, load_config, to_toml,
                                              validate)
from torchtitan_lite.config.sections import (ActivationCheckpoint, Checkpoint, Comm, Compile, ConfigError,
                                             FaultTolerance, Float8, Job, JobConfig, LRScheduler, Metrics, Mixture,
                                             Model, Moe, Muon, Optimizer, Parallelism, Phase, Source, Training,
                                             Validation, opt)

__all__ = ["OPTIONS", "SECTIONS", "TABLES", "ActivationCheckpoint", "Checkpoint", "Comm", "Compile", "ConfigError",
           "FaultTolerance", "Float8", "Job", "JobConfig", "LRScheduler", "Metrics", "Mixture", "Model", "Moe",
           "Muon", "Optimizer", "Parallelism", "Phase", "Source", "Training", "Validation", "did_you_mean", "help_text",
           "load_config", "opt", "to_toml", "validate"]
