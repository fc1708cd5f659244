"""The suite's probes of what a run does inside, in one 4-process torchrun job: a job costs seconds of start-up
(the launcher, every rank importing torch), and none of these needs a process of its own.

    probes.py SPEC_JSON     SPEC: {kind: [OUT_DIR, args...]} for any of
      "init": [OUT_DIR, CONFIG, LAYOUTS_JSON]            every layout's initial weights (dump_init.py)
      "syncs...": [OUT_DIR, TRAIN_ARGS...]               a run's host-device syncs, dumped in OUT_DIR (sync_count.py)
      "collectives": [OUT_DIR, LAYOUTS_JSON, TRAIN_ARGS...]  each layout's step-2 collectives (tools/comm_count.py)

Each test module registers its part at import (`register`); conftest.probes makes every registered part in one job
on first use, or at the end of the job of the 4-process resumed runs where a session makes both (several_runs.py
then calls `run`). The default process group is made once and kept: the runs build their own meshes and subgroups,
as in several_runs.py; the syncs and collectives each patch the loader's next_batch, restored after each.
"""

import json
import sys
from pathlib import Path

REGISTERED: dict[str, list[str]] = {}


def register(kind: str, *args: str) -> None:
    REGISTERED[kind] = list(args)


def run(spec: dict, device) -> int:
    """Every part of `spec` (SPEC_JSON's), in this process of a job whose default process group exists and whose
    train.init_distributed returns `device`: 0, or the first failing part's exit code."""
    import train
    from dump_init import dump
    from torchtitan_lite.data.loader import DataLoader
    from torchtitan_lite.tools import comm_count, sync_count

    next_batch, code = DataLoader.next_batch, 0
    if "init" in spec:
        dump(Path(spec["init"][0]), spec["init"][1], json.loads(spec["init"][2]), device)
    for kind in (k for k in spec if k.startswith("syncs")):
        code = code or sync_count.main(train.run, [*spec[kind], "--job.dump_folder", spec[kind][0]])
        DataLoader.next_batch = next_batch
    if "collectives" in spec:
        code = code or comm_count.main(train, spec["collectives"])
        DataLoader.next_batch = next_batch
    return code


if __name__ == "__main__":
    import torch.distributed as dist

    import train
    from torchtitan_lite.runtime.process import Env, init_distributed

    device, destroy = init_distributed(Env.from_environ()), dist.destroy_process_group
    train.init_distributed = lambda *a, **k: device
    dist.destroy_process_group = lambda *a, **k: None
    code = run(json.loads(Path(sys.argv[1]).read_text()), device)
    dist.barrier()  # gloo can abort a process that exits while a peer still sends
    destroy()
    sys.exit(code)
