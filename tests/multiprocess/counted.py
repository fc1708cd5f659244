"""train.py under one of the library's counters (torchtitan_lite/tools), launched by torchrun for the tests:

    counted.py syncs OUT_DIR TRAIN_ARGS...                 (tools/sync_count.py; test_syncs.py)
    counted.py collectives OUT_DIR LAYOUTS TRAIN_ARGS...   (tools/comm_count.py; test_collectives.py)
"""

import sys

import train
from torchtitan_lite.tools import comm_count, sync_count

kind, argv = sys.argv[1], sys.argv[2:]
sys.exit(sync_count.main(train.run, argv) if kind == "syncs" else comm_count.main(train, argv))
