"""Imported first by every Python process the suite starts (tests/conftest.py puts this folder on PYTHONPATH):
torchrun's launcher and workers, the scripts, `train.py --check`.

Such a process imports torch, which makes millions of objects and no garbage worth collecting: the cyclic collector,
run every 700 allocations, walks them again and again (an eighth of `import train`'s CPU time, measured), and every
rank and launcher of every job pays it on the suite's few cores. So automatic collection is off from the start;
train.py's run turns it back on as it returns (its loop collects on a schedule of its own meanwhile), and a script
that never does simply runs without it for its few seconds. At exit, the interpreter's last collection would walk
every one of torch's objects once more: freezing the heap in the last atexit handler (registered first, so it runs
last: after logging's and torch's have flushed and closed what they hold) leaves it nothing to walk. What a test sees
is what the process did; only unreachable reference cycles, whose finalizers Python never promises to run, wait.
"""

import atexit
import gc

gc.disable()
atexit.register(gc.freeze)
