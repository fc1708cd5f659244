"""Low-precision training, swapped into the model before parallelism.
- float8.py: float8 matmuls through torchao: which linears convert, and what float8 changes in TP and FSDP
- mxfp8_experts.py: MXFP8 grouped matmuls for a mixture's routed experts (torchao's moe_training), and their refusals

Imports config and the models' MoE block (torchao where either is on); parallel and training build on it.
"""
