"""torchtitan_lite: a small, readable torchtitan-style pretraining codebase for Llama models.

Its layers, bottom to top; a module imports only from its own layer or those below it (tests/test_layout.py):
- config: the typed run configuration (TOML, command line, validation), its rules and path resolution
- runtime: the process around the math: process group, errors, signals, numerics, metrics, run history
- models: the Llama architecture, its layout-invariant initialization, its Hugging Face names and layouts
- quantization: float8 matmuls through torchao, and what float8 changes in the layouts
- data: text sources, file formats, tokenizers, mixtures, and the loader that hands each rank its windows
- parallel: the layout (dims, mesh) and the parallelisms applied from outside: TP/FSDP/AC/compile, pipeline, CP
- checkpoint: DCP saves and resumes, safe reading, deletion off the training path, finding a run's checkpoint
- training: what updates the weights: the step, the checks and plan before it, optimizer, schedule, clipping
- tools: what stands beside training: memory estimator, generation, HF conversion, sync and collective counters
train.py, scripts/ and benchmarks/ sit on top and import the package like any user code.
"""
