"""Low-precision training: float8 matmuls through torchao (float8.py), swapped into the model before parallelism,
with what float8 changes in the layouts (TP styles, FSDP's float8 all-gather and its scales).

Imports config only (torchao where float8 is on); parallel and training build on it.
"""
