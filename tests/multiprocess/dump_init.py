"""Run under torchrun: for each layout, build the debug model on that mesh, initialize it, and have rank 0 save the
full (gathered) parameters, so a test can compare initial weights across layouts. All layouts share one launch.

    dump_init.py OUT_DIR CONFIG '{"name": [overrides...], ...}'   ->   OUT_DIR/name.pt
"""

import json
import sys
from pathlib import Path

import torch

from torchtitan_lite.config import load_config
from torchtitan_lite.models.llama import FLAVORS, Transformer
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.parallelize import parallelize
from torchtitan_lite.runtime.process import Env, init_distributed

out, config, layouts = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
env = Env.from_environ()
device = init_distributed(env)
for name, overrides in layouts.items():
    cfg = load_config(["--job.config_file", config, *overrides])
    dims = ParallelDims.from_config(cfg.parallelism, env.world_size)
    mesh = dims.build_mesh(device.type)[0]
    with torch.device("meta"):
        model = Transformer(FLAVORS["debugmodel"].with_(vocab_size=258, max_seq_len=cfg.training.seq_len))
    parallelize(model, mesh, dims, cfg)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.training.seed)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for n, p in model.named_parameters()}
    if env.rank == 0:
        torch.save(full, out / f"{name}.pt")
torch.distributed.barrier()  # gloo can abort a process that exits while a peer still sends
torch.distributed.destroy_process_group()
