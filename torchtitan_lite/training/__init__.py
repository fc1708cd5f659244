"""What updates the weights: optimizer, learning-rate schedule and gradient clipping (optim.py).

May import every layer below it; only tools, train.py and scripts import it.
"""
