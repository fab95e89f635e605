"""Parallel sizes, validated in one place: the trainer, the process groups and the planner all call `validate`.

Layout: SP groups are blocks of consecutive ranks (`[0..sp)`, `[sp..2sp)`, ...) so that, with ranks numbered node
by node as every launcher does, an SP group (whose all-to-alls run twice per layer) stays inside a node. The
data-parallel groups are the strided sets `{j, j+sp, j+2sp, ...}`. Every message names the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    world_size: int  # every rank of the job
    sp_size: int  # ranks sharing one sequence (consecutive ranks); the rest of the world is data parallel

    def __post_init__(self):
        if self.sp_size < 1:
            raise ConfigError(f"--sp_size must be >= 1, got {self.sp_size}")
        if self.world_size % self.sp_size != 0:
            raise ConfigError(f"--sp_size {self.sp_size} does not divide the world size {self.world_size}: choose a "
                              f"divisor of {self.world_size} (the remaining factor is data parallel)")

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def sp_group_ranks(self, rank: int) -> list[int]:
        start = rank // self.sp_size * self.sp_size
        return list(range(start, start + self.sp_size))

    def dp_group_ranks(self, rank: int) -> list[int]:
        return list(range(rank % self.sp_size, self.world_size, self.sp_size))


def check_heads(sp_size: int, q_heads: int, kv_heads: int) -> None:
    """Ulysses gives each SP rank `q_heads / sp` query heads, and either `kv_heads / sp` KV heads or one replicated
    one."""
    if q_heads % sp_size != 0:
        raise ConfigError(f"--sp_size {sp_size} must divide the model's {q_heads} attention heads")
    if kv_heads % sp_size != 0 and sp_size % kv_heads != 0:
        raise ConfigError(f"--sp_size {sp_size} and the model's {kv_heads} KV heads: one must divide the other "
                          f"(KV heads are split when sp divides them and replicated when they divide sp)")


def check_lengths(sp_size: int, lengths: dict[str, int], pad_to_sp: bool) -> None:
    """Each sequence length (by the flag that sets it) is cut into sp equal shards, unless padding is allowed."""
    for flag, length in lengths.items():
        if length % sp_size and not pad_to_sp:
            raise ConfigError(f"--{flag} {length} is not a multiple of --sp_size {sp_size}: change it, or pass "
                              f"--pad_to_sp to pad each sequence (padding is not trained on)")


def validate(world_size: int, sp_size: int, q_heads: int, kv_heads: int, lengths: Optional[dict[str, int]] = None,
             pad_to_sp: bool = False) -> ParallelDims:
    """Every divisibility rule of a run; returns its dims or raises a ConfigError naming the flag."""
    dims = ParallelDims(world_size, sp_size)
    check_heads(sp_size, q_heads, kv_heads)
    check_lengths(sp_size, lengths or {}, pad_to_sp)
    return dims


def valid_sp_sizes(world_size: int, q_heads: int, kv_heads: int, requested: Optional[int] = None) -> list[int]:
    """The SP sizes `validate` accepts for this world and model (only `requested`, if given)."""
    sizes = [requested] if requested else range(1, world_size + 1)
    valid = []
    for sp in sizes:
        try:
            validate(world_size, sp, q_heads, kv_heads)
        except ConfigError:
            continue
        valid.append(sp)
    return valid
