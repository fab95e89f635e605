"""Several datasets in one run (--dataset given several times, or a YAML list: axolotl's `datasets:`), each read in
its own format and cut into its own samples (packing never mixes two datasets in one sample), then drawn together.

An entry is a path or hub id, or a mapping with `path` and any of: `split`, `data_format`, `text_column`,
`messages_field`, `role_map` (the flags of the same names, for this dataset), and how many of its samples a pass over
the mixture holds:

    samples: N    N samples (fewer than it has: a seeded choice of them; more: all of them, then again, repeated)
    weight: w     w x its samples (0.5: half of them; 2: each twice), rounded; the default is 1 (each once)

The run's --chat_template, --loss_on, --truncation and --packing apply to each dataset they concern (a text dataset
in a mixture trains every token). The mixture's samples are the entries' in turn, shuffled together like any
dataset's (a fresh permutation each epoch, fixed by --seed: data/sources.py); with --epochs, an epoch is one pass
over the mixture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class DatasetEntry:
    path: str
    split: Optional[str] = None  # None: the run's --dataset_split (or --eval_split)
    data_format: Optional[str] = None  # None: the run's flag, and so on
    text_column: Optional[str] = None
    messages_field: Optional[str] = None
    role_map: Optional[object] = None
    weight: Optional[float] = None
    samples: Optional[int] = None

    def count(self, available: int) -> int:
        """How many samples of this dataset a pass over the mixture holds."""
        if self.samples is not None:
            return self.samples
        return max(1, round((1.0 if self.weight is None else self.weight) * available))

    def describe(self, available: int) -> str:
        share = (f"{self.samples:,} samples" if self.samples is not None else
                 f"weight {self.weight:g}" if self.weight is not None else "each once")
        return f"{self.path}: {self.count(available):,} of its {available:,} samples ({share})"


ENTRY_KEYS = tuple(f.name for f in fields(DatasetEntry))


def dataset_entries(value, flag: str = "dataset") -> list[DatasetEntry]:
    """--dataset as entries: a path, a mapping, or a list of either."""
    values = value if isinstance(value, list) else [value]
    return [_entry(v, flag) for v in values]


def is_mixture(entries: list[DatasetEntry]) -> bool:
    """More than one dataset, or one whose share is set: anything but the plain one-dataset run."""
    return len(entries) > 1 or any(e.weight is not None or e.samples is not None for e in entries)


def _entry(value, flag: str) -> DatasetEntry:
    if isinstance(value, str):
        return DatasetEntry(value)
    if not isinstance(value, dict) or not value.get("path"):
        raise ConfigError(f"--{flag}: an entry is a path or a mapping with a path, got {value!r}")
    unknown = sorted(set(value) - set(ENTRY_KEYS))
    if unknown:
        raise ConfigError(f"--{flag} {value['path']}: unknown key(s) {', '.join(unknown)}; an entry takes "
                          f"{', '.join(ENTRY_KEYS)}")
    entry = DatasetEntry(**value)
    if entry.weight is not None and entry.samples is not None:
        raise ConfigError(f"--{flag} {entry.path}: give weight or samples, not both")
    if entry.weight is not None and not (isinstance(entry.weight, (int, float)) and math.isfinite(entry.weight)
                                         and entry.weight > 0):
        raise ConfigError(f"--{flag} {entry.path}: weight must be a positive number, got {entry.weight!r}")
    if entry.samples is not None and not (isinstance(entry.samples, int) and entry.samples > 0):
        raise ConfigError(f"--{flag} {entry.path}: samples must be a positive whole number, got {entry.samples!r}")
    return entry


class MixtureSource:
    """The samples of several sources (data/sources.py's interface): entry j contributes `counts[j]` samples, drawn
    from its own by a seeded permutation per pass over it."""

    def __init__(self, sources: list, counts: list[int], seed: int):
        self.sources, self.counts, self.seed = sources, counts, seed
        self.starts = [0]
        for count in counts:
            self.starts.append(self.starts[-1] + count)
        self.num_samples = self.starts[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """(entry, that entry's sample) of mixture sample `index`."""
        j = next(j for j in range(len(self.counts)) if index < self.starts[j + 1])
        k, available = index - self.starts[j], self.sources[j].num_samples
        cycle, offset = divmod(k, available)
        generator = torch.Generator().manual_seed(self.seed * 7907 + j * 104729 + cycle)
        return j, int(torch.randperm(available, generator=generator)[offset])

    def get(self, index: int):
        j, local = self.locate(index)
        return self.sources[j].get(local)
