"""several_runs.py with rank 1's data loading slowed by SECONDS per batch: a straggler (test_profiling.py).

    slow_data.py SECONDS RUNS_JSON
"""

import os
import runpy
import sys
import time
from pathlib import Path

from torchtitan_lite.data.loader import DataLoader

delay = float(sys.argv.pop(1))
if os.environ["RANK"] == "1":
    next_batch = DataLoader.next_batch
    DataLoader.next_batch = lambda self: time.sleep(delay) or next_batch(self)
runpy.run_path(str(Path(__file__).with_name("several_runs.py")), run_name="__main__")
