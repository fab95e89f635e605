"""A validation split held out of the training data (`--val_set_size`, axolotl's `val_set_size`): a fixed choice of
the source's samples, by the seed alone, so it is the same whatever the layout (SP, DP, world size) and on every
rank; the training source then holds the rest, and no held-out sample is ever trained on.

    fraction under 1   round(fraction x samples) of them (at least 1)
    a whole number     that many samples
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

SPLIT_SALT = 104729  # the split's permutation is not any epoch's order (sources.sample_order)


class Subset:
    """Some of a source's samples, in a fixed order: `num_samples` and `get(index)` like any source."""

    def __init__(self, source, indices: list[int]):
        self.source, self.indices = source, indices
        self.num_samples = len(indices)

    def get(self, index: int):
        return self.source.get(self.indices[index])


def held_out_count(size: float, available: int) -> int:
    """How many of `available` samples `--val_set_size size` holds out."""
    count = max(1, round(size * available)) if size < 1 else int(size)
    if count >= available:
        raise ConfigError(f"--val_set_size {size:g} holds out {count} of the {available} samples of --dataset, "
                          f"leaving none to train on: give a smaller fraction or count")
    return count


def split_off(source, size: float, seed: int) -> tuple[Subset, Subset]:
    """(training, eval) sources: the eval set is the first `held_out_count` of a seeded permutation, both kept in
    the source's order."""
    if source.num_samples is None:
        raise ConfigError("--val_set_size holds out part of --dataset: generated tokens have no end to split")
    count = held_out_count(size, source.num_samples)
    order = torch.randperm(source.num_samples, generator=torch.Generator().manual_seed(seed * SPLIT_SALT + 1))
    held = sorted(order[:count].tolist())
    kept = sorted(order[count:].tolist())
    return Subset(source, kept), Subset(source, held)
