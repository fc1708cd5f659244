"""DeepSeek-V3: the shared decoder with multi-head latent attention (common/mla.py) and DeepSeek's mixture (sigmoid
scores, a selection bias, group-limited routing, a shared expert, the first blocks dense), behind one spec.
- model.py: its args and flavors, debugmodel, 16B and 671B
- hf.py: its Hugging Face adapter, DeepseekV3ForCausalLM's names and config.json, both ways
- spec.py: the ModelSpec naming them with the shared decoder, the MLA TP plan, its FLOP count and the adapter
"""
