"""A training step and what it needs: the train and eval step over a local batch, written once, with the pipeline
schedule as a second implementation of the same call (step.py); the checks a config passes before any process
talks to another (preflight.py); optimizer, learning-rate schedule and gradient clipping (optim.py).

May import every layer below it; only tools, train.py and scripts import it.
"""
