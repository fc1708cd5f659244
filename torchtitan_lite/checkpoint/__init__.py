"""Checkpoints: what a resume restores, how a save stays atomic, and the checkpoint a tool is pointed at.
- manager.py: DCP saves and loads, what a resume restores, atomic publishing, async saves
- states.py: what a checkpoint holds besides the optimizer and the data: progress, the weights, the RNG
- folder.py: the folder's rules: which steps are complete, which one a run resumes from, which to delete
- reader.py: reading DCP files safely, and in one process (scripts, tests, export, generation)
- trash.py: the renames that publish a save, and deleting old checkpoints off the training path
- finder.py: the checkpoint and config a tool is pointed at
- hf_load.py: a run's start from a Hugging Face folder (each rank its own pieces, one tensor at a time), and
  reading such a folder, for the converters too

Imports config, runtime and models (a model's Hugging Face adapter); training and tools build on it.
"""
