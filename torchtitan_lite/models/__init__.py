"""The models, as single-device code (a model file never mentions a mesh), each architecture a folder behind a spec.
- spec.py: ModelSpec, what the layers know of a model (class, flavors, TP plan, FLOPs, Hugging Face adapter)
- registry.py: the specs by name, what model.name selects; the built-in ones register there
- common: what the architectures share: the decoder, attention, rotary embeddings, norms and feed-forwards, the
  mixture of experts, the TP plan
- llama3: Llama 3 and its flavors, tiny and debugmodel to 405B and MoE ones, with its Hugging Face adapter
- qwen3: Qwen3 and its flavors, dense and mixtures of experts
- deepseek_v3: DeepSeek-V3 and its flavors: latent attention, group-limited routing, a shared expert
- documents.py: document masking (block_causal): each document's attention mask and rotary positions in a window
- init.py: layout-invariant initialization, each element a function of (seed, parameter name, global index)
- init_cpu.py: init.py's fill on the host, through init_fill.c (a C loop built at first use)

Imports config and runtime only: parallelism is applied to the model from outside (parallel/).
"""
