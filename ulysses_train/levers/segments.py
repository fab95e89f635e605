"""Segments of checkpointed layers that share one checkpoint (`--checkpoint_every K`, levers/placement.py).

torch's non-reentrant checkpoint saves each layer's input through the saved-tensor hooks active around it
(`_CheckpointFrame.save_inputs`), then recomputes the layer from that input before its backward. Here the first
layer of each segment saves its input as usual (on the GPU, or to the host through the offload); the others save a
`_Regenerate` token instead. When the backward unpacks the first token of a segment (its last layer, which the
backward reaches first), the segment's layers run forward once more from the segment's checkpoint, without a
gradient and with each layer's random state of the forward, and leave each later layer's input for its own
recompute; each is dropped once handed out. So K - 1 layer forwards per segment buy K - 1 checkpoints fewer, and
at most K - 1 inputs are alive at once.

Why not torch's `checkpoint_sequential` (a checkpoint per segment, its layers recomputed together with a gradient):
that keeps the whole activations of K layers through the segment's backward, tens of hidden states each at long
context; nesting the per-layer checkpoints inside the segment's keeps one layer's. Why tokens rather than wrapping
K layers in one function: transformers' decoder loop calls every layer itself, and each layer's
`_gradient_checkpointing_func` is the one thing we own.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from .offload import HostOffload


class Segment:
    """One segment's state through a step: its checkpoint (a tensor, or the offload's item for it), and per layer
    the forward to run again, its other arguments and its random state; then the inputs it regenerated."""

    def __init__(self, offload: Optional[HostOffload]):
        self.offload = offload
        self.start = None  # the first layer's saved input: a tensor, or the offload's item
        self.steps: list[tuple] = []  # (function, other args, cpu rng, device rng) of each layer but the last
        self.inputs: dict[int, torch.Tensor] = {}  # offset in the segment -> its regenerated input
        self.done = False

    def record(self, function, args: tuple) -> None:
        devices, states = get_device_states(*args)
        self.steps.append((function, args[1:], torch.get_rng_state(), devices, states))

    def _source(self) -> torch.Tensor:
        if isinstance(self.start, torch.Tensor):
            return self.start
        return self.offload.peek(self.start)

    def input(self, offset: int) -> torch.Tensor:
        """The input of the segment's layer at `offset` (> 0), regenerating all of them on the first ask."""
        if not self.done:
            if self.start is None:
                raise RuntimeError("--checkpoint_every: a segment's checkpoint is gone (a second backward through "
                                   "the same graph is not supported)")
            hidden = self._source()
            with torch.no_grad():
                for i, (function, rest, cpu_state, devices, states) in enumerate(self.steps):
                    with torch.random.fork_rng(devices=devices):
                        torch.set_rng_state(cpu_state)
                        set_device_states(devices, states)
                        out = function(hidden, *rest)
                    hidden = out[0] if isinstance(out, (tuple, list)) else out
                    self.inputs[i + 1] = hidden
            self.start, self.steps, self.done = None, [], True
        return self.inputs.pop(offset)


class _Regenerate:
    """What a layer inside a segment saves in place of its input."""

    def __init__(self, segment: Segment, offset: int):
        self.segment, self.offset = segment, offset


def _same(t: torch.Tensor, hidden: torch.Tensor) -> bool:
    return t.data_ptr() == hidden.data_ptr() and t.shape == hidden.shape and t.dtype == hidden.dtype


class SegmentHooks(torch.autograd.graph.saved_tensors_hooks):
    """Around one checkpointed layer of a segment: its input `hidden` (what torch's checkpoint saves of it) goes
    to the segment, the offload or nowhere; every other saved tensor to the offload if there is one, else kept."""

    def __init__(self, segment: Segment, offset: int, hidden: torch.Tensor, offload: Optional[HostOffload]):
        self.segment, self.offset, self.hidden, self.offload = segment, offset, hidden, offload
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if self.hidden is not None and _same(t, self.hidden):
            self.hidden = None  # once: the checkpoint saves its input once
            if self.offset > 0:
                return _Regenerate(self.segment, self.offset)
            item = self.offload._pack(t) if self.offload is not None else t
            self.segment.start = item
            return item
        return self.offload._pack(t) if self.offload is not None else t

    def _unpack(self, item):
        if isinstance(item, _Regenerate):
            return item.segment.input(item.offset)
        return self.offload._unpack(item) if self.offload is not None else item


class SegmentChain:
    """The segments of one model's checkpointed layers, in the order the forward meets them: `hooks` for the layer
    at `offset` of its segment opens a new segment at offset 0 and adds to the open one otherwise."""

    def __init__(self):
        self.open: Optional[Segment] = None

    def hooks(self, offset: int, last: bool, function, args: tuple, offload: Optional[HostOffload]) -> SegmentHooks:
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError("--checkpoint_every needs each decoder layer's hidden states as its first positional "
                            "argument (how transformers' checkpointed layers pass them)")
        if offset == 0:
            self.open = Segment(offload)
        segment = self.open
        if segment is None:
            raise RuntimeError("--checkpoint_every: a layer inside a segment ran before the segment's first layer")
        if not last:  # the last layer's output is the next segment's input, not regenerated
            segment.record(function, args)
        else:
            self.open = None  # the step's graph holds the segment from here on
        return SegmentHooks(segment, offset, args[0], offload)
