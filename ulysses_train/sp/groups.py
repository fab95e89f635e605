"""Sequence-parallel process groups (layout and validation: dims.py), handed to DeepSpeed as its `mpu`.

ZeRO partitions parameters, gradients and optimizer states over *all* ranks (DeepSpeed's "sequence data parallel"
group), because SP ranks hold identical parameters just as DP ranks do.

The object implements the interface of DeepSpeed's `parallel_state_sp` module, which is what
`deepspeed.initialize(mpu=...)` and `zero.Init` read: DeepSpeed then computes batch sizes with
dp = world / sp and averages gradients over the whole world.
"""

from __future__ import annotations

import torch.distributed as dist

from .dims import ParallelDims


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


class SequenceParallelGroups:
    """Creates the SP and DP process groups (collectively, on every rank) and exposes DeepSpeed's mpu interface."""

    def __init__(self, sp_size: int):
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed (deepspeed.init_distributed) before building SP groups")
        world, rank = dist.get_world_size(), dist.get_rank()
        self.dims = ParallelDims(world, sp_size)
        self.rank = rank
        self.sp_group = self.dp_group = None
        # new_group is collective: every rank creates every group, in the same order
        for first in range(0, world, sp_size):
            ranks = self.dims.sp_group_ranks(first)
            group = dist.new_group(ranks)
            if rank in ranks:
                self.sp_group = group
        for first in range(sp_size):
            ranks = self.dims.dp_group_ranks(first)
            group = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group = group
        self.world_group = dist.new_group(list(range(world)))
        # no tensor or pipeline parallelism: a model-parallel group of one rank each (DeepSpeed's gradient clipping
        # outside ZeRO reduces the norm over it)
        for other in range(world):
            group = dist.new_group([other])
            if other == rank:
                self.model_parallel_group = group

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

    def get_model_parallel_group(self):
        return self.model_parallel_group


def local_world_size() -> int:
    """Ranks on this host (collective): the default --sp_size keeps one sequence inside a node."""
    import socket

    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts.count(socket.gethostname())
