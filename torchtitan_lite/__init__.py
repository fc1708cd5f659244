"""torchtitan_lite: a small, readable torchtitan-style pretraining codebase for Llama models."""
