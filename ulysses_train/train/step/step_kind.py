"""What one optimizer step and one evaluation of a run are: next-token loss (loop.py, evaluate.py) or preference
pairs (train/preference/pairs.py). The trainer holds the one its data needs (`Trainer.step_kind`) and the loop calls it,
so the loop and the evaluation import nothing of the preference code, which builds on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class StepKind:
    accumulate: Callable  # (run, step, finish) -> (loss, [tokens, conversations], skipped): the step's micro-steps
    evaluate: Callable  # (run, source, max_samples) -> {"eval_loss": ..., ...}: the eval set's loss and metrics
