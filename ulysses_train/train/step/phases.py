"""The phases of a training step, for tools that watch one: the engine's forward, its backward (with the
recompute of checkpointed layers), its optimizer step, and the loss head inside the forward. `wrap_phases` runs each
inside a context manager of the caller's (a timer, a memory tracker's phase marker, a profiler range)."""

from __future__ import annotations

from typing import Callable, ContextManager, Optional

ENGINE_PHASES = (("forward", "forward"), ("backward", "backward"), ("step", "optimizer"))  # (method, phase)


def wrap_phases(engine, loss_head: Optional[object], context: Callable[[str], ContextManager]) -> None:
    """Replaces (on these instances) engine.forward/backward/step and loss_head.forward by wrappers that run the
    original inside `context(phase)`, phase being "forward", "backward", "optimizer" or "loss"."""
    for method, phase in ENGINE_PHASES:
        setattr(engine, method, _within(getattr(engine, method), phase, context))
    if loss_head is not None:
        loss_head.forward = _within(loss_head.forward, "loss", context)


def _within(fn, phase: str, context: Callable[[str], ContextManager]):
    def wrapper(*args, **kwargs):
        with context(phase):
            return fn(*args, **kwargs)
    return wrapper
