"""Low-precision training, swapped into the model before parallelism.
- float8.py: float8 matmuls through torchao: which linears convert, and what float8 changes in TP and FSDP

Imports config only (torchao where float8 is on); parallel and training build on it.
"""
