"""What stands beside training and reuses its pieces: the memory estimator (memory.py), generation (generation.py),
Hugging Face conversion (hf_convert.py), and the measuring code that benchmarks and tests share (sync_count.py:
host-device syncs; comm_count.py: collectives).

The top layer of the package: it may import any layer, and none imports it. train.py, scripts/ and benchmarks/
sit above it.
"""
