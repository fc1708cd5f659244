"""train.py that records the collectives of one whole training step, for several layouts in one launch
(torchtitan_lite/tools/comm_count.py).

    comm_count.py OUT_DIR '{"name": [overrides...], ...}' TRAIN_ARGS...   ->   OUT_DIR/name.json (rank 0)
"""

import sys

import train
from torchtitan_lite.tools import comm_count

sys.exit(comm_count.main(train, sys.argv[1:]))
