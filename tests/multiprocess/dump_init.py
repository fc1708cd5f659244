"""For each layout, build the config's model on that mesh, initialize it, and have rank 0 save the full (gathered)
parameters, so a test can compare initial weights across layouts (test_init_layouts.py; run in probes.py's job).

    dump(OUT_DIR, CONFIG, {"name": [overrides...], ...}, device)   ->   OUT_DIR/name.pt
"""

import torch
import torch.distributed as dist

from launch import TINY_VOCAB
from torchtitan_lite.config import load_config
from torchtitan_lite.models import registry
from torchtitan_lite.parallel.dims import ParallelDims
from torchtitan_lite.parallel.parallelize import parallelize


def dump(out, config: str, layouts: dict[str, list[str]], device: torch.device) -> None:
    for name, overrides in layouts.items():
        cfg = load_config(["--job.config_file", config, *overrides])
        dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
        mesh = dims.build_mesh(device.type)[0]
        spec = registry.get(cfg.model.name)
        with torch.device("meta"):
            model = spec.model_class(spec.run_args(cfg, TINY_VOCAB))
        parallelize(model, mesh, dims, cfg, spec.tp_plan)
        model.to_empty(device=device)
        model.init_weights(seed=cfg.training.seed)
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                for n, p in model.named_parameters()}
        if dist.get_rank() == 0:
            torch.save(full, out / f"{name}.pt")
