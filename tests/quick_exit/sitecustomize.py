"""Imported first by every Python process the suite starts (tests/conftest.py puts this folder on PYTHONPATH):
torchrun's launcher and workers, the scripts, `train.py --check`.

Such a process has imported torch, and the interpreter's last garbage collection, after the atexit handlers, walks
every one of torch's objects: CPU time spent after the process's work is done, paid by every rank and launcher of
every job on the suite's few cores. Freezing the heap in the last atexit handler (registered first, so it runs last:
after logging's and torch's have flushed and closed what they hold) leaves that collection nothing to walk. What a
test sees is what the process did before it exited; only unreachable reference cycles, whose finalizers Python never
promises to run at exit, are no longer collected.
"""

import atexit
import gc

atexit.register(gc.freeze)
