"""Checkpoints: what a resume restores and how a save stays atomic (manager.py), the folder's rules (folder.py: which
steps are complete, which one a run resumes from, which to delete), reading DCP files safely in one
process (reader.py), deleting old ones off the training path (trash.py), and the checkpoint and config a tool is
pointed at (finder.py).

Imports config and runtime; training and tools build on it.
"""
