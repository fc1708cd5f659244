"""The blocks every architecture here is built from, single-device code like the models.
- decoder.py: the decoder (embedding, blocks, final norm, output; tied embeddings), its args' fields, FLOPs per token
- attention.py: grouped-query attention with optional QK-norm and a swappable attend
- mla.py: multi-head latent attention (DeepSeek-V3): low-rank query and key/value latents, a shared rotated key part
- kv_cache.py: the KV cache the decoder makes for generation (Decoder.kv_cache)
- rope.py: rotary tables (Llama 3.1's scaling and YaRN among them) and the rotation of queries and keys
- layers.py: RMSNorm and the SwiGLU feed-forward
- moe.py: a mixture-of-experts feed-forward (router, routed experts by grouped GEMM, shared experts)
- parallelize.py: the decoder's tensor-parallel plans (grouped-query attention's, MLA's), and the sizes they split
- hf.py: what the Hugging Face adapters share: the decoder's names, the RoPE row permutation, rope_theta
"""
