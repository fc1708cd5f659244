"""train.py on a filesystem where deleting a folder takes SECONDS, as a multi-terabyte checkpoint on a parallel
filesystem would: shutil.rmtree sleeps that long first.

    slow_delete.py SECONDS TRAIN_ARGS...
"""

import shutil
import sys
import time

import train

seconds, argv = float(sys.argv[1]), sys.argv[2:]
rmtree = shutil.rmtree


def slow_rmtree(*args, **kwargs):
    time.sleep(seconds)
    return rmtree(*args, **kwargs)


shutil.rmtree = slow_rmtree
sys.exit(train.run(argv))
