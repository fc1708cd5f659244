"""The model: the Llama architecture as single-device code (llama.py), its layout-invariant initialization
(init.py), and its names and layouts in Hugging Face's format (hf.py). A model file never mentions a mesh.

Imports config and runtime only: parallelism is applied to the model from outside (parallel/).
"""
