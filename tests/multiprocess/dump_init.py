"""Run under torchrun: build the debug model on the given mesh, initialize it, and have rank 0 save the full
(gathered) parameters to argv[1], so a test can compare initial weights across layouts."""

import sys

import torch

from torchtitan_lite.config import load_config
from torchtitan_lite.distributed import Env, init_distributed
from torchtitan_lite.model import FLAVORS, Transformer
from torchtitan_lite.parallel_dims import ParallelDims
from torchtitan_lite.parallelize import parallelize

out, argv = sys.argv[1], sys.argv[2:]
cfg, env = load_config(argv), Env.from_environ()
dims = ParallelDims.from_config(cfg.parallelism, env.world_size)
device = init_distributed(env)
mesh, _ = dims.build_mesh(device.type)
with torch.device("meta"):
    model = Transformer(FLAVORS["debugmodel"].with_(vocab_size=258, max_seq_len=cfg.training.seq_len))
parallelize(model, mesh, dims, cfg)
model.to_empty(device=device)
model.init_weights(seed=cfg.training.seed)
full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for n, p in model.named_parameters()}
if env.rank == 0:
    torch.save(full, out)
torch.distributed.barrier()  # gloo can abort a process that exits while a peer still sends
torch.distributed.destroy_process_group()
