"""Several train.py runs one after another in the same torchrun job, so they pay its start-up once (the launcher,
every rank importing torch, the first process group): a job of 4 ranks costs seconds before its first step.

    several_runs.py RUNS_JSON [PROBES_SPEC]
      RUNS_JSON: a list of [dump folder, record gradients (grad_dump.py), train args]
      PROBES_SPEC: probes.py's, whose parts run after the runs, in the same processes

Each run is train.run as in a job of its own: its own mesh and subgroups, seed, data, dump folder, torch.compile
caches and graph counts; only the default process group is made once and kept (comm_count.py does the same).
"""

import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import probes
import train
from grad_dump import recording

# Automatic collection on between the runs, so that each run's garbage goes (train.run leaves it as it found it),
# what the imports made frozen first (sitecustomize.py kept collection off meanwhile): no collection walks torch's
# objects again, 0.17 s each time on every rank.
gc.freeze()
gc.enable()
init_distributed, destroy = train.init_distributed, dist.destroy_process_group
train.init_distributed = lambda *a, **k: torch.device("cpu") if dist.is_initialized() else init_distributed(*a, **k)
dist.destroy_process_group = lambda *a, **k: None
for folder, record, argv in json.loads(Path(sys.argv[1]).read_text()):
    Path(folder).mkdir(parents=True, exist_ok=True)
    if "torch._dynamo" in sys.modules:  # compiled graphs, their caches and counts as in a new process
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    start, cpu = time.perf_counter(), time.process_time()
    with recording(Path(folder)) if record else contextlib.nullcontext():
        if (code := train.run(argv)) != 0:
            sys.exit(code)
    if dist.get_rank() == 0:  # where a shared job's time goes, in its log
        print(f"several_runs: {Path(folder).name} took {time.perf_counter() - start:.1f} s, rank 0's CPU "
              f"{time.process_time() - cpu:.1f} s", flush=True)
if len(sys.argv) > 2 and (code := probes.run(json.loads(Path(sys.argv[2]).read_text()), torch.device("cpu"))):
    sys.exit(code)
# No rank exits while a send of its last run may still be in flight: gloo (torch 2.13) can abort such a process at
# exit ("terminate called without an active exception", as checkpoint/manager.py says of rank 0's broadcasts), seen
# once on one rank of the 8-process job after both its runs had trained.
dist.barrier()
destroy()
