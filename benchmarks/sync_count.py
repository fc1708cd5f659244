"""train.py that records every host-device sync of its training steps (torchtitan_lite/tools/sync_count.py).

    sync_count.py OUT_DIR TRAIN_ARGS...   ->   OUT_DIR/syncs-RANK.json: {step: ["file:function@device", ...]}
"""

import sys

import train
from torchtitan_lite.tools import sync_count

sys.exit(sync_count.main(train.run, sys.argv[1:]))
