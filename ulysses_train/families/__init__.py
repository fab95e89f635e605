"""The model families the trainer runs: one `FamilyRecord` each (records.py), by `model_type`.

The support check (sp/support.py), the sizes (model/geometry.py), the config check (model/config_check.py), the
lever policy and the planner all read a family's facts here, so adding a family is one record and its test
(tests/unit/test_families.py). This package sits below every other: it imports nothing of the trainer.
"""

from __future__ import annotations

from typing import Optional

from .record import ALL_KERNELS, MLP_KINDS, FamilyRecord
from .records import RECORDS

# model_type -> its record, in the table's order
FAMILIES: dict[str, FamilyRecord] = {r.model_type: r for r in RECORDS}


def record_of(model_type) -> Optional[FamilyRecord]:
    """The record of `model_type`, or None for a family the trainer does not run."""
    return FAMILIES.get(model_type)


def families_with(field: str) -> list[str]:
    """The model types whose record sets `field`, in the table's order (for the messages that name them)."""
    return [t for t, r in FAMILIES.items() if getattr(r, field)]


__all__ = ["ALL_KERNELS", "FAMILIES", "MLP_KINDS", "FamilyRecord", "RECORDS", "families_with", "record_of"]
