"""Parallel sizes, validated in one place: `validate`, which layout.py calls for the trainer and the planner.

Layout: SP groups are blocks of consecutive ranks (`[0..sp)`, `[sp..2sp)`, ...) so that, with ranks numbered node
by node as every launcher does, an SP group stays inside a node when it fits in one. The data-parallel groups are
the strided sets `{j, j+sp, j+2sp, ...}`. Every message names the flag to change.

Inside an SP group of `sp = ulysses x ring` ranks (`--ring_size`), the Ulysses groups are blocks of `ulysses`
consecutive ranks (their two all-to-alls per layer stay on one node's links) and the ring runs across them: ring
group `u` is `{u, u + ulysses, u + 2 ulysses, ...}` (offsets inside the SP group). SP rank `r` is Ulysses rank
`r % ulysses` of ring rank `r // ulysses`. With 8 GPUs a node and `--sp_size 32 --ring_size 4`, each node is one
Ulysses group of 8 and each ring goes through the four nodes, one GPU per node, passing K/V blocks from node to
node while the all-to-alls never leave a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

from ..errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    world_size: int  # every rank of the job
    sp_size: int  # ranks sharing one sequence (consecutive ranks); the rest of the world is data parallel
    ring_size: int = 1  # ring degree inside an SP group; sp_size / ring_size is the Ulysses degree

    def __post_init__(self):
        if self.sp_size < 1:
            raise ConfigError(f"--sp_size must be >= 1, got {self.sp_size}")
        if self.world_size % self.sp_size != 0:
            raise ConfigError(f"--sp_size {self.sp_size} does not divide the world size {self.world_size}: choose a "
                              f"divisor of {self.world_size} (the remaining factor is data parallel)")
        if self.ring_size < 1:
            raise ConfigError(f"--ring_size must be >= 1, got {self.ring_size}")
        if self.sp_size % self.ring_size != 0:
            raise ConfigError(f"--ring_size {self.ring_size} does not divide --sp_size {self.sp_size}: the SP group "
                              f"is Ulysses x ring, so choose a divisor of {self.sp_size}")

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def ulysses_size(self) -> int:
        return self.sp_size // self.ring_size

    def sp_group_ranks(self, rank: int) -> list[int]:
        start = rank // self.sp_size * self.sp_size
        return list(range(start, start + self.sp_size))

    def dp_group_ranks(self, rank: int) -> list[int]:
        return list(range(rank % self.sp_size, self.world_size, self.sp_size))

    def ulysses_group_ranks(self, rank: int) -> list[int]:
        start = rank // self.ulysses_size * self.ulysses_size
        return list(range(start, start + self.ulysses_size))

    def ring_group_ranks(self, rank: int) -> list[int]:
        first = rank // self.sp_size * self.sp_size + rank % self.ulysses_size
        return list(range(first, first + self.sp_size, self.ulysses_size))


def ulysses_heads_error(ulysses: int, q_heads: int, kv_heads: int) -> Optional[str]:
    """Why `ulysses` ranks cannot split these heads (None if they can): each takes `q_heads / ulysses` query heads,
    and either `kv_heads / ulysses` KV heads or one replicated one."""
    if q_heads % ulysses != 0:
        return f"must divide the model's {q_heads} attention heads"
    if kv_heads % ulysses != 0 and ulysses % kv_heads != 0:
        return (f"and the model's {kv_heads} KV heads: one must divide the other (KV heads are split when the "
                f"Ulysses degree divides them and replicated when they divide it)")
    return None


def largest_ulysses(sp_size: int, q_heads: int, kv_heads: int) -> int:
    """The largest Ulysses degree dividing `sp_size` that the heads allow (1 always does)."""
    return max(u for u in range(1, sp_size + 1) if sp_size % u == 0 and not ulysses_heads_error(u, q_heads, kv_heads))


def resolve_ring_size(ring_size: Union[int, str], sp_size: int, q_heads: int, kv_heads: int) -> int:
    """`--ring_size auto`: the smallest ring that leaves a Ulysses degree the heads allow; a number is kept."""
    if ring_size == "auto":
        return sp_size // largest_ulysses(sp_size, q_heads, kv_heads)
    return int(ring_size)


def check_heads(sp_size: int, q_heads: int, kv_heads: int, ring_size: int = 1) -> None:
    """The Ulysses part (`sp_size / ring_size` ranks) must be able to split the heads."""
    ulysses = sp_size // ring_size
    error = ulysses_heads_error(ulysses, q_heads, kv_heads)
    if error is None:
        return
    ring = sp_size // largest_ulysses(sp_size, q_heads, kv_heads)
    hint = (f"; or keep it with a ring over the rest: --ring_size {ring} (Ulysses {sp_size // ring} x ring {ring}), "
            f"which --ring_size auto (the default) picks" if ring > ring_size else "")
    if ring_size == 1:
        raise ConfigError(f"--sp_size {sp_size} {error}{hint}")
    raise ConfigError(f"--sp_size {sp_size} / --ring_size {ring_size} = Ulysses degree {ulysses} {error}{hint}")


def sequence_multiple(sp_size: int, ring_size: int = 1) -> int:
    """What every sequence length must be a multiple of. A ring cuts the sequence into 2 x ring chunks (zigzag: ring
    rank i holds chunks i and 2 ring - 1 - i), whose pairs the Ulysses ranks split again: lcm(2 ring, sp)."""
    return sp_size if ring_size == 1 else math.lcm(2 * ring_size, sp_size)


def check_lengths(sp_size: int, lengths: dict[str, int], pad_to_sp: bool, ring_size: int = 1) -> None:
    """Each sequence length (by the flag that sets it) is cut into equal shards, unless padding is allowed."""
    multiple = sequence_multiple(sp_size, ring_size)
    of = f"--sp_size {sp_size}" if ring_size == 1 else \
        f"{multiple} (2 x --ring_size {ring_size} zigzag chunks, split over --sp_size {sp_size})"
    for flag, length in lengths.items():
        if length % multiple and not pad_to_sp:
            raise ConfigError(f"--{flag} {length} is not a multiple of {of}: change it, or pass --pad_to_sp to pad "
                              f"each sequence (padding is not trained on)")


def validate(world_size: int, sp_size: int, q_heads: int, kv_heads: int, lengths: Optional[dict[str, int]] = None,
             pad_to_sp: bool = False, ring_size: int = 1) -> ParallelDims:
    """Every divisibility rule of a run; returns its dims or raises a ConfigError naming the flag."""
    dims = ParallelDims(world_size, sp_size, ring_size)
    check_heads(sp_size, q_heads, kv_heads, ring_size)
    check_lengths(sp_size, lengths or {}, pad_to_sp, ring_size)
    return dims


def valid_sp_sizes(world_size: int, q_heads: int, kv_heads: int, requested: Optional[int] = None,
                   ring: bool = False) -> list[int]:
    """The SP sizes `validate` accepts for this world and model (only `requested`, if given): with pure Ulysses, or
    with `ring`, with the ring `--ring_size auto` would choose (any size then works)."""
    sizes = [requested] if requested else range(1, world_size + 1)
    valid = []
    for sp in sizes:
        ring_size = resolve_ring_size("auto", sp, q_heads, kv_heads) if ring else 1
        try:
            validate(world_size, sp, q_heads, kv_heads, ring_size=ring_size)
        except ConfigError:
            continue
        valid.append(sp)
    return valid
