"""The run's configuration: the sections and their options (sections.py), loading, overrides and checks
(job_config.py), the values a field accepts (rules.py) and where a path resolves (paths.py). The bottom layer: it
imports nothing else of the package, and every layer reads it.

The one package that re-exports: `from torchtitan_lite.config import JobConfig` is how every layer names its config.
"""

from torchtitan_lite.config.job_config import OPTIONS, SECTIONS, TABLES, help_text, load_config, to_toml, validate
from torchtitan_lite.config.sections import (ActivationCheckpoint, Checkpoint, Comm, Compile, ConfigError, Float8, Job,
                                             JobConfig, LRScheduler, Metrics, Mixture, Model, Optimizer, Parallelism,
                                             Phase, Source, Training, Validation, opt)

__all__ = ["OPTIONS", "SECTIONS", "TABLES", "ActivationCheckpoint", "Checkpoint", "Comm", "Compile", "ConfigError",
           "Float8", "Job", "JobConfig", "LRScheduler", "Metrics", "Mixture", "Model", "Optimizer", "Parallelism",
           "Phase", "Source", "Training", "Validation", "help_text", "load_config", "opt", "to_toml", "validate"]
