"""Data: where text comes from and its file formats (files.py), tokenizers (tokenizer.py, hf_tokenizer.py), and
the loader that packs tokens into windows in one global order and hands each rank its slice (loader.py).

Imports config, runtime and models (the counter-based generator of models/init.py orders the windows).
"""
