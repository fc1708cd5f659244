"""The parallel layout: degrees, their validation, and the device mesh."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan_lite.config import ConfigError, Parallelism

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the mesh's dims, outermost first


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    pp: int = 1
    cp: int = 1
    ep: int = 1  # a split of dp_shard x cp x tp (not a dim of the mesh): the routed experts' ranks

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> ParallelDims:
        pp, replicate, shard, cp, tp = (cfg.pipeline_parallel_degree, cfg.data_parallel_replicate_degree,
                                        cfg.data_parallel_shard_degree, cfg.context_parallel_degree,
                                        cfg.tensor_parallel_degree)
        if shard == -1:
            if world_size % (pp * replicate * cp * tp):
                raise ConfigError(
                    f"world size {world_size} is not divisible by pipeline_parallel_degree {pp} x "
                    f"data_parallel_replicate_degree {replicate} x context_parallel_degree {cp} x "
                    f"tensor_parallel_degree {tp}: change the degrees or the number of processes")
            shard = world_size // (pp * replicate * cp * tp)
        if pp * replicate * shard * cp * tp != world_size:
            raise ConfigError(
                f"parallelism degrees multiply to {pp * replicate * shard * cp * tp} (pp {pp} x replicate {replicate} "
                f"x shard {shard} x cp {cp} x tp {tp}) but the world size is {world_size}: make them multiply to "
                f"{world_size}, or set parallelism.data_parallel_shard_degree = -1")
        group, sharded = cfg.fsdp_reshard_after_forward, shard * cp  # FSDP shards over dp_shard x cp
        if group.isdecimal() and replicate * sharded > 1 and sharded % int(group):
            divisors = [d for d in range(1, sharded + 1) if sharded % d == 0]
            raise ConfigError(f"parallelism.fsdp_reshard_after_forward = {group} must divide the FSDP shard degree "
                              f"{sharded}: choose one of {', '.join(map(str, divisors))} (e.g. the GPUs per node)")
        if cfg.fsdp_cpu_offload and cfg.fsdp_offload_pin_memory and not torch.cuda.is_available():
            raise ConfigError("parallelism.fsdp_offload_pin_memory needs a GPU (pinned memory speeds host-to-device "
                              "copies): pass --no-parallelism.fsdp_offload_pin_memory to offload on this machine")
        # The expert-parallel degree is checked with the model (check_experts): its choices must split the experts too.
        return cls(replicate, shard, tp, world_size, pp, cp, cfg.expert_parallel_degree)

    def check_experts(self, num_experts: int) -> None:
        """ConfigError unless the expert-parallel degree divides both the ranks that route different tokens (dp_shard
        x cp x tp, but replicas), which the experts' ranks are borrowed from, and the routed experts; the degrees it
        offers instead pass both, so the next check accepts whichever the user picks."""
        ep, tokens = self.ep, self.dp_shard * self.cp * self.tp
        choices = ", ".join(str(d) for d in range(1, tokens + 1) if tokens % d == 0 and num_experts % d == 0)
        if tokens % ep:
            what = " x ".join(f"{name} {d}" for name, d in (("dp_shard", self.dp_shard), ("cp", self.cp),
                                                            ("tp", self.tp)) if d > 1 or name == "dp_shard")
            raise ConfigError(f"parallelism.expert_parallel_degree {ep} must divide {what} = {tokens} (the ranks "
                              f"that route different tokens, which the experts' ranks are borrowed from): choose one "
                              f"of {choices} (these divide the {num_experts} routed experts too)")
        if num_experts % ep:
            raise ConfigError(f"parallelism.expert_parallel_degree {ep} must divide the {num_experts} routed experts "
                              f"(moe.num_experts): choose one of {choices} (these divide {tokens}, the ranks that "
                              "route different tokens, too)")

    def layout(self) -> str:
        """The mesh in words: its dims of degree > 1, outermost first ("dp_shard 2 x tp 2")."""
        degrees = zip(DIMS, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp))
        layout = " x ".join(f"{name} {d}" for name, d in degrees if d > 1) or "1 process"
        borrowed = " x ".join(n for n, d in (("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp)) if d > 1)
        return layout + (f" (experts over ep {self.ep} of {borrowed})" if self.ep > 1 else "")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """Whether FSDP is applied (or HSDP, or DDP as HSDP with shard degree 1): over dp_shard x cp, since context
        parallel ranks hold the same weights and each computes gradients from its share of the tokens."""
        return self.dp * self.cp > 1

    def global_batch(self, local_batch: int, global_batch: int) -> int:
        """training.global_batch_size, resolved (-1: one micro-batch per data-parallel rank). It must split into
        whole micro-batches on every rank, a condition an elastic job meets or fails anew at every size."""
        per_step = local_batch * self.dp
        if global_batch == -1:
            return per_step
        if global_batch % per_step:
            n = global_batch // local_batch if global_batch % local_batch == 0 else 0
            others = self.tp * self.pp * self.cp
            sizes = [d * others for d in range(1, n + 1) if n % d == 0 and d % self.dp_replicate == 0]
            raise ConfigError(
                f"training.global_batch_size {global_batch} is not a multiple of local_batch_size {local_batch} x "
                f"data-parallel degree {self.dp}: use a multiple of {per_step}"
                + (f", or a world size of {', '.join(map(str, sizes))}" if sizes else ""))
        return global_batch

    def validate_model(self, tp_sizes: dict[str, int]) -> None:
        """The sizes the model's TP plan splits (its spec's tp_sizes: heads, hidden sizes, by name) must split
        evenly across tensor-parallel ranks (the sequence across cp ranks: see context_parallel.check_cp)."""
        for name, size in tp_sizes.items():
            if size % self.tp:
                raise ConfigError(
                    f"model {name} = {size} is not divisible by parallelism.tensor_parallel_degree = {self.tp}: "
                    f"choose a degree that divides {size}")

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
        """One mesh ("pp", "dp_replicate", "dp_shard", "cp", "tp"); its data-parallel dims flattened into one
        ("dp"), the data loader's rank; and the group that sums the logged loss (dp; cp, whose ranks hold parts of
        the sequences; pp, whose last stage alone has it).

        Only the dims of degree > 1 get process groups of their own (as torchtitan builds only those): a dim's
        groups cost every rank a `new_group` call per subgroup, for a degree-1 dim one per rank of the world, and
        a group to join that no collective needs. The dims of degree 1 share this rank's own group instead, so
        every name the code slices is there, with a group (FSDP's HSDP mesh uses a dp_shard of 1: plain DDP).
        See benchmarks/mesh_build.py.
        """
        degrees = dict(zip(DIMS, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)))
        parallel = {name: d for name, d in degrees.items() if d > 1}
        groups = {}
        if parallel:
            real = init_device_mesh(device_type, tuple(parallel.values()), mesh_dim_names=tuple(parallel))
            groups = {name: real.get_group(name) for name in parallel}
        own = _own_group() if len(parallel) < len(DIMS) else None
        mesh = DeviceMesh.from_group([groups.get(name, own) for name in DIMS], device_type,
                                     mesh=torch.arange(self.world_size).view(*degrees.values()), mesh_dim_names=DIMS)
        dp_mesh = _flat(mesh, "dp", ("dp_replicate", "dp_shard"))
        if self.pp * self.cp == 1:
            return mesh, dp_mesh, dp_mesh
        return mesh, dp_mesh, _flat(mesh, "loss", ("pp", "dp_replicate", "dp_shard", "cp"))

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """FSDP's mesh: (dp_replicate, shard dim) under HSDP, else the shard dim alone; the shard dim is dp_shard, or
        under CP dp_shard x cp flattened ("dp_shard_cp"), since context-parallel ranks hold the same weights."""
        if self.cp == 1:
            return mesh["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else mesh["dp_shard"]
        if self.dp_replicate == 1:
            return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")._unflatten(
            "dp_cp", (self.dp_replicate, self.dp_shard * self.cp), ("dp_replicate", "dp_shard_cp"))

    def moe_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards a mixture of experts' parameters on: FSDP's, and under TP with tp joined to its shard
        dim ("dp_shard_cp_tp"), since the tp ranks of a sequence-parallel block route different tokens."""
        if self.tp == 1:
            return self.fsdp_mesh(mesh)
        shard, size = ("dp_shard", "cp", "tp"), self.dp_shard * self.cp * self.tp
        if self.dp_replicate == 1:
            return mesh[shard]._flatten("dp_shard_cp_tp")
        return mesh[("dp_replicate", *shard)]._flatten("dp_cp_tp")._unflatten(
            "dp_cp_tp", (self.dp_replicate, size), ("dp_replicate", "dp_shard_cp_tp"))

    def experts_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The routed experts' mesh under expert parallelism: moe_mesh's shard dim (dp_shard, x cp, x tp: ranks that
        route different tokens) split into ("efsdp", "ep"), ep innermost (its ranks adjacent: a node's; the tp ranks
        first, then the cp ones), after dp_replicate. The experts are split over ep and FSDP-sharded over efsdp (and
        replicated over dp_replicate) where the rest of the mixture is FSDP-sharded over all of the shard dim."""
        shard = "dp_shard_cp_tp" if self.tp > 1 else "dp_shard_cp" if self.cp > 1 else "dp_shard"
        size = self.dp_shard * self.cp * self.tp
        return self.moe_mesh(mesh)._unflatten(shard, (size // self.ep, self.ep), ("efsdp", "ep"))

    def sequence_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The ranks that hold parts of the same sequences: cp x tp (sequence parallel), flattened ("cp_tp")."""
        return _flat(mesh, "cp_tp", ("cp", "tp"))

    def token_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """Every rank that holds different tokens of a step: data, context and tensor (sequence) parallel, flattened
        ("tokens"): a mixture of experts' load is summed over them (not over pp: its stages hold other layers)."""
        return _flat(mesh, "tokens", ("dp_replicate", "dp_shard", "cp", "tp"))


def _flat(mesh: DeviceMesh, name: str, dims: tuple[str, ...]) -> DeviceMesh:
    """`dims` of `mesh` as one dim `name`. Flattening makes new groups; with at most one of the dims of degree > 1,
    that dim's group (or, with none, this rank's own) is already the flat group."""
    parallel = tuple(d for d in dims if mesh[d].size() > 1)
    if len(parallel) > 1:
        return mesh[parallel]._flatten(name)
    return DeviceMesh.from_group(mesh.get_group((parallel or dims)[0]), mesh.device_type, mesh_dim_names=(name,))


def _own_group() -> dist.ProcessGroup:
    """A group of this rank alone. Made with local synchronization, so no other rank takes part in its creation
    (NCCL creates the communicator on first use: the default group is not eagerly initialized, see
    runtime/process.py)."""
    if dist.get_world_size() == 1:
        return dist.group.WORLD
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)
