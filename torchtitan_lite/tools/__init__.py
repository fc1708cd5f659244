"""What stands beside training and reuses its pieces.
- memory.py: the memory a config would need per rank, from the trainer's own code run on fake tensors
- memory_tracker.py: the tracker memory.py runs a step under: the device's peak, and each block's
- memory_extrapolate.py: a model of alike blocks estimated from a few of them, where that is exact
- memory_routing.py: the routing a mixture of experts is traced with (balanced, or its worst case's bound)
- generation.py: text generation from a trained model, decoded with a KV cache
- hf_convert.py: our DCP checkpoints to and from a Hugging Face Llama folder, streamed one tensor at a time
- sync_count.py: every host-device sync of a run's steps, with the line that asked for it (benchmarks and tests)
- comm_count.py: the collectives of one training step, for several layouts in one launch (benchmarks and tests)

The top layer of the package: it may import any layer, and none imports it. train.py, scripts/ and benchmarks/
sit above it.
"""
