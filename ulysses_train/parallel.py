"""Sequence-parallel process groups, built and validated in one place, and handed to DeepSpeed as its `mpu`.

Layout: SP groups are blocks of consecutive ranks (`[0..sp)`, `[sp..2sp)`, ...) so that, with ranks numbered
node by node as every launcher does, an SP group (whose all-to-alls run twice per layer) stays inside a node.
The data-parallel groups are the strided sets `{j, j+sp, j+2sp, ...}`. ZeRO partitions parameters, gradients and
optimizer states over *all* ranks (DeepSpeed's "sequence data parallel" group), because SP ranks hold identical
parameters just as DP ranks do.

The object implements the interface of DeepSpeed's `parallel_state_sp` module, which is what
`deepspeed.initialize(mpu=...)` and `zero.Init` read: DeepSpeed then computes batch sizes with
dp = world / sp and averages gradients over the whole world.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .config import ConfigError


def disable_deepspeed_shm_allreduce() -> None:
    """Stop DeepSpeed's CPU backend from building its shared-memory all-reduce.

    Why: on the CPU accelerator, every process DeepSpeed's comm layer wraps compiles (JIT, tens of seconds) a
    shared-memory all-reduce and creates a 66 MB `/dev/shm/deepspeed_allreduce_buffer_*` segment that it never
    unlinks. Each CPU run leaked 132 MB of RAM-backed tmpfs per two ranks; a test suite fills a 24 GB machine and
    gets OOM-killed. The op serves only `inference_all_reduce`, which training never calls; gloo does the rest.
    Call before the first `deepspeed.init_distributed` or `deepspeed.initialize`."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def init_distributed(backend: str) -> None:
    """`deepspeed.init_distributed` without the leaking CPU shared-memory op (see above)."""
    import deepspeed

    disable_deepspeed_shm_allreduce()
    deepspeed.init_distributed(dist_backend=backend)


def validate_sp_size(sp_size: int, world_size: int) -> int:
    """Returns the data-parallel size; raises a ConfigError naming --sp_size when the split is impossible."""
    if sp_size < 1:
        raise ConfigError(f"--sp_size must be >= 1, got {sp_size}")
    if world_size % sp_size != 0:
        raise ConfigError(f"--sp_size {sp_size} does not divide the world size {world_size}: choose a divisor of "
                          f"{world_size} (the remaining factor is data parallel)")
    return world_size // sp_size


def validate_heads(sp_size: int, q_heads: int, kv_heads: int) -> None:
    """Ulysses gives each SP rank `q_heads / sp` query heads, and either `kv_heads / sp` KV heads or one replicated one."""
    if q_heads % sp_size != 0:
        raise ConfigError(f"--sp_size {sp_size} must divide the model's {q_heads} attention heads")
    if kv_heads % sp_size != 0 and sp_size % kv_heads != 0:
        raise ConfigError(f"--sp_size {sp_size} and the model's {kv_heads} KV heads: one must divide the other "
                          f"(KV heads are split when sp divides them and replicated when they divide sp)")


@dataclass
class ParallelDims:
    world_size: int
    sp_size: int

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def sp_group_ranks(self, rank: int) -> list[int]:
        start = rank // self.sp_size * self.sp_size
        return list(range(start, start + self.sp_size))

    def dp_group_ranks(self, rank: int) -> list[int]:
        return list(range(rank % self.sp_size, self.world_size, self.sp_size))


class SequenceParallelGroups:
    """Creates the SP and DP process groups (collectively, on every rank) and exposes DeepSpeed's mpu interface."""

    def __init__(self, sp_size: int):
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed (deepspeed.init_distributed) before building SP groups")
        world, rank = dist.get_world_size(), dist.get_rank()
        validate_sp_size(sp_size, world)
        self.dims = ParallelDims(world, sp_size)
        self.rank = rank
        self.sp_group = self.dp_group = None
        # new_group is collective: every rank creates every group, in the same order
        for start in range(0, world, sp_size):
            ranks = list(range(start, start + sp_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.sp_group = group
        for offset in range(sp_size):
            ranks = list(range(offset, world, sp_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group = group
        self.world_group = dist.new_group(list(range(world)))

    # ---- our own accessors ----
    @property
    def sp_size(self) -> int:
        return self.dims.sp_size

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size

    # ---- DeepSpeed mpu interface (the functions of deepspeed.runtime.sequence_parallel.parallel_state_sp) ----
    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        # DeepSpeed detects an SP mpu by this attribute; the groups were built in __init__
        if sequence_parallel_size != self.sp_size:
            raise ValueError(f"SP groups were built for sp_size {self.sp_size}, not {sequence_parallel_size}")

    def get_sequence_parallel_group(self):
        return self.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.sp_rank

    def get_sequence_data_parallel_group(self):
        return self.world_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.dims.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.rank

    # no tensor/pipeline parallelism: DeepSpeed's checkpointing asks for these
    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0
