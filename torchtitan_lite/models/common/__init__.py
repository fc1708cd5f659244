"""The blocks every architecture here is built from, single-device code like the models.
- decoder.py: the decoder (embedding, blocks, final norm, output; tied embeddings), its args' fields, FLOPs per token
- block.py: a decoder block, attention and a feed-forward (dense or a mixture of experts) around pre-norms
- mtp.py: a multi-token prediction module (DeepSeek-V3): a block fed the depth before's output and later tokens
- attention.py: grouped-query attention with optional QK-norm and a swappable attend
- mla.py: multi-head latent attention (DeepSeek-V3): low-rank query and key/value latents, a shared rotated key part
- kv_cache.py: the KV cache the decoder makes for generation (Decoder.kv_cache)
- rope.py: rotary tables (Llama 3.1's scaling and YaRN among them) and the rotation of queries and keys
- layers.py: RMSNorm and the SwiGLU feed-forward
- moe.py: a mixture-of-experts feed-forward (router, routed experts by grouped GEMM, shared experts)
- capacity.py: the optional expert capacity: which slots of a sequence an expert takes, the rest dropped
- parallelize.py: the decoder's tensor-parallel plans (grouped-query attention's, MLA's), and the sizes they split
- hf.py: what the Hugging Face adapters share: the decoder's names, the RoPE row permutation, rope_theta
"""
