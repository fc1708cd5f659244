"""Qwen3, dense and mixtures of experts: the shared decoder with Qwen3's choices, behind one spec (models/spec.py).
- model.py: its args and flavors, debugmodel and debugmodel_moe to 32B and 235B-A22B
- hf.py: its Hugging Face names and config.json, Qwen3's and Qwen3-MoE's, both ways
- spec.py: the ModelSpec naming them with the shared decoder and TP plan, and hf.py's adapter
"""
