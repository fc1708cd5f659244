"""The model, as single-device code: a model file never mentions a mesh.
- llama.py: the Llama 3 architecture and its flavors, tiny and debugmodel to 405B
- documents.py: document masking (block_causal): each document's attention mask and rotary positions in a window
- init.py: layout-invariant initialization, each element a function of (seed, parameter name, global index)
- init_cpu.py: init.py's fill on the host, through init_fill.c (a C loop built at first use)
- hf.py: Hugging Face's parameter names, weight layouts and config.json, both ways

Imports config and runtime only: parallelism is applied to the model from outside (parallel/).
"""
