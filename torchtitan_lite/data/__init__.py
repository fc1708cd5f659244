"""Data: where text comes from, how it becomes tokens, and the order in which each rank gets its windows.
- files.py: files, documents, token shards and Hugging Face streams, and how each becomes tokens
- tokenizer.py: the tiktoken BPE plus BOS/EOS: byte level, the project's BPE, Llama 3's, or a folder's (Qwen's)
- hf_tokenizer.py: our tokenizer to and from Hugging Face's format, as plain JSON; the run's, maybe a folder's
- tokenizer_json.py: a Hugging Face tokenizer.json as tiktoken reproduces it (Llama 3's, Qwen's), or why not
- loader.py: sources of windows in one global order, packing, and the loader that hands each rank its slice
- mixture.py: several sources in one order, each with an exact quota of every global batch, phase by phase
- synthetic.py: the default data, windows with learnable structure from hashing alone, no files to read
- digest.py: what shaped a run's past windows, so that a resume which would replay or skip some is refused

Imports config, runtime and models (the counter-based generator of models/init.py orders the windows).
"""
