"""Imported first by every Python process the suite starts (tests/conftest.py puts this folder on PYTHONPATH):
torchrun's launcher and workers, the scripts, `train.py --check`.

Such a process imports torch, which makes millions of objects and no garbage worth collecting: the cyclic collector,
run every 700 allocations, walks them again and again (an eighth of `import train`'s CPU time, measured), and every
rank and launcher of every job pays it on the suite's few cores. So automatic collection is off from the start, and
stays off: train.py's run leaves it as it found it (its loop collects on a schedule of its own), and a script runs
without it for its few seconds (several_runs.py, which trains run after run, freezes what its imports made and
turns it on between the runs). At exit, the interpreter's last collection would walk every one of torch's objects
once more: freezing the heap in the last atexit handler (registered first, so it runs last: after logging's and
torch's have flushed and closed what they hold) leaves it nothing to walk. What a test sees is what the process
did; only unreachable reference cycles, whose finalizers Python never promises to run, wait.

A process of a shared job made in the background (launch.in_background) takes the lowest CPU priority, so that it
runs on what the tests in front leave idle (it still slows them somewhat: the cores share caches and memory).
torchrun starts every worker in a session of its own, and where the kernel groups processes by session (autogroup),
a nice value only ranks a process inside its own group: so a session leader lowers its group's too.
"""

import atexit
import gc
import os

gc.disable()
atexit.register(gc.freeze)

if os.environ.get("SUITE_BACKGROUND") == "1":
    os.nice(19)
    if os.getsid(0) == os.getpid():  # never the group of a session it shares with the tests in front
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write("19")
        except OSError:  # no autogroups on this kernel: the nice value alone ranks it
            pass

if os.environ.get("SUITE_GATE") and "TORCHELASTIC_RUN_ID" in os.environ:
    # A worker of a job the test holds or kills at a known step, started by run_train.sh (tests/multiprocess/gate.py).
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "multiprocess"))
    import gate

    gate.install_from_env()
