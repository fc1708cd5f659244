"""The models, as single-device code (a model file never mentions a mesh), each architecture a folder behind a spec.
- spec.py: ModelSpec, what the layers know of a model (class, flavors, TP plan, FLOPs, Hugging Face adapter)
- registry.py: the specs by name, what model.name selects; the built-in ones register there
- llama3: Llama 3 and its flavors, tiny and debugmodel to 405B and MoE ones, with its TP plan and Hugging Face
  adapter
- documents.py: document masking (block_causal): each document's attention mask and rotary positions in a window
- moe.py: a mixture-of-experts feed-forward (router, routed experts by grouped GEMM, shared experts) for any model
- init.py: layout-invariant initialization, each element a function of (seed, parameter name, global index)
- init_cpu.py: init.py's fill on the host, through init_fill.c (a C loop built at first use)

Imports config and runtime only: parallelism is applied to the model from outside (parallel/).
"""
