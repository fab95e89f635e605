"""The learning-rate schedule: a factor of --lr for each optimizer step, from the flags alone.

    warmup    steps 0 .. W-1: (step + 1) / (W + 1) of --lr, W = --warmup_steps, else ceil(--warmup_ratio x steps),
              else steps // 10
    then      cosine: from --lr down to --lr x --min_lr_ratio along half a cosine, at the last step
              linear: the same ends along a straight line (transformers' linear schedule with --min_lr_ratio 0)
              constant_with_warmup: --lr

Step s (0-based) of the run trains with lr x factor(s); the factor is a pure function of the step and the flags,
so a resumed run is put on the schedule of its own flags at the resumed step (resume.py: apply_schedule). The
factors are plain functions, not objects: LambdaLR saves an object's state in the checkpoint and would put it back
over the new flags' schedule on resume.
"""

from __future__ import annotations

import math
from typing import Callable, Optional


def warmup_steps(steps: int, warmup: Optional[int], ratio: Optional[float]) -> int:
    """--warmup_steps when given and > 0 (as in transformers, it wins over the ratio), else ceil(ratio x steps),
    else a tenth of the steps."""
    if warmup:
        return warmup
    if ratio is not None:
        return math.ceil(ratio * steps)
    return 0 if warmup == 0 else steps // 10


def lr_factor(kind: str, total_steps: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    """The factor of --lr at each 0-based step."""
    def decay(progress: float) -> float:  # 1 at the end of the warmup, 0 at the last step
        if kind == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        return 1 - progress  # linear

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant_with_warmup":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_ratio + (1 - min_ratio) * decay(progress)
    return factor


def warmup_cosine(total_steps: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    """The default schedule (--lr_scheduler_type cosine)."""
    return lr_factor("cosine", total_steps, warmup, min_ratio)
