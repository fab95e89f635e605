"""Sequence-parallel process groups (layout and validation: dims.py), handed to DeepSpeed as its `mpu`.

With a ring (`--ring_size` > 1) each SP group is further cut into Ulysses groups (consecutive ranks: the
all-to-alls) and ring groups (one rank of each Ulysses group: the K/V blocks' point-to-point sends). DeepSpeed sees
only the whole SP group: how it is cut inside changes nothing for ZeRO, the loss or the gradients.

ZeRO partitions parameters, gradients and optimizer states over *all* ranks (DeepSpeed's "sequence data parallel"
group), because SP ranks hold identical parameters just as DP ranks do.

The object implements the interface of DeepSpeed's `parallel_state_sp` module, which is what
`deepspeed.initialize(mpu=...)` and `zero.Init` read: DeepSpeed then computes batch sizes with
dp = world / sp and averages gradients over the whole world.
"""

from __future__ import annotations

import torch.distributed as dist

from .dims import ParallelDims
from .weak_group import WeakGroup


def _bind_world_defaults_early() -> None:
    """torch.distributed.nn.functional and torch.distributed._shard take `group.WORLD` as a default argument when
    they are imported. Imported once a process group exists (torch._dynamo imports them, and transformers' masking
    utilities import torch._dynamo on the first register_ulysses_attention), they keep the default group and its
    gloo worker threads alive past destroy_process_group into interpreter exit, where the process can abort
    (`terminate called without an active exception`). Imported with this package, before any group exists, they
    bind None."""
    if dist.is_available() and not dist.is_initialized():
        import torch.distributed._shard.api  # noqa: F401
        import torch.distributed.nn.functional  # noqa: F401


_bind_world_defaults_early()


def _weak_group_property(name: str) -> property:
    return property(lambda self: getattr(self, name).get(),
                    lambda self, group: setattr(self, name, WeakGroup(group)))


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
    """Creates the SP and DP process groups (collectively, on every rank) and exposes DeepSpeed's mpu interface.
    The groups are held weakly (WeakGroup): `destroy_process_group()` ends them whatever still refers to this."""

    sp_group = _weak_group_property("_sp_group")
    ulysses_group = _weak_group_property("_ulysses_group")
    ring_group = _weak_group_property("_ring_group")
    dp_group = _weak_group_property("_dp_group")
    world_group = _weak_group_property("_world_group")
    model_parallel_group = _weak_group_property("_model_parallel_group")

    def __init__(self, sp_size: int, ring_size: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed (deepspeed.init_distributed) before building SP groups")
        world, rank = dist.get_world_size(), dist.get_rank()
        self.dims = ParallelDims(world, sp_size, ring_size)
        self.rank = rank
        # new_group is collective: every rank creates every group, in the same order
        self.sp_group = self._new_groups(self.dims.sp_group_ranks, range(0, world, sp_size))
        # Ulysses x ring inside each SP group; without a ring the Ulysses group is the SP group
        self.ulysses_group, self.ring_group = self.sp_group, None
        if ring_size > 1:
            ulysses = self.dims.ulysses_size
            self.ulysses_group = self._new_groups(self.dims.ulysses_group_ranks, range(0, world, ulysses))
            # ring groups start at the first `ulysses` ranks of each SP group
            self.ring_group = self._new_groups(self.dims.ring_group_ranks, [
                start + u for start in range(0, world, sp_size) for u in range(ulysses)])
        self.dp_group = self._new_groups(self.dims.dp_group_ranks, range(sp_size))
        self.world_group = dist.new_group(list(range(world)))
        # no tensor or pipeline parallelism: a model-parallel group of one rank each (DeepSpeed's gradient clipping
        # outside ZeRO reduces the norm over it)
        for other in range(world):
            group = dist.new_group([other])
            if other == rank:
                self.model_parallel_group = group

    def own_groups(self) -> list:
        """This rank's groups, each once (the Ulysses group may be the SP group), for a process whose default group
        outlives the run to destroy them (train/process/teardown.py); none that is gone already."""
        groups = []
        for name in ("_sp_group", "_ulysses_group", "_ring_group", "_dp_group", "_world_group",
                     "_model_parallel_group"):
            try:
                group = getattr(self, name).get()
            except RuntimeError:  # destroyed
                continue
            if group is not None and not any(group is other for other in groups):
                groups.append(group)
        return groups

    def _new_groups(self, ranks_of, firsts):
        """The group `ranks_of(first)` for each of `firsts` (collective: every rank creates all); returns this
        rank's."""
        mine = None
        for first in firsts:
            ranks = ranks_of(first)
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    # ---- our own accessors ----
    @property
    def sp_size(self) -> int:
        return self.dims.sp_size

    @property
    def ring_size(self) -> int:
        return self.dims.ring_size

    @property
    def ulysses_size(self) -> int:
        return self.dims.ulysses_size

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses_size

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.ulysses_size

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
