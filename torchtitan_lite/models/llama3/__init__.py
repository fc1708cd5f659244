"""Llama 3: the shared decoder (models/common/) with Llama's args and flavors, behind one spec (models/spec.py).
- model.py: its args and flavors, tiny and debugmodel to 405B, and Mixtral-style mixtures
- hf.py: Hugging Face's parameter names, weight layouts and config.json, both ways (Llama and Mixtral)
- spec.py: the ModelSpec naming them with the shared decoder and TP plan
"""
