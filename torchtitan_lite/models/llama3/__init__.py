"""Llama 3: the architecture, its flavors and what the layers need of it, behind one spec (models/spec.py).
- model.py: the model, single-device code, and its flavors, tiny and debugmodel to 405B
- parallelize.py: its tensor-parallel plan, module name to style, and the sizes the plan splits
- hf.py: Hugging Face's parameter names, weight layouts and config.json, both ways
- spec.py: the ModelSpec naming them, and the FLOPs of a token
"""
