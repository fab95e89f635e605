"""Activation checkpointing of every decoder layer, with kept attention outputs (`--attn_recompute never`).

Selective checkpointing that saves the attention kernel's outputs (the output and its log-sum-exp) in the forward,
so the recompute before a layer's backward re-runs everything except the kernel, the most expensive op at long
context (what keeping them saves: docs/benchmarks.md, "What each lever buys"). Costs `layers x (s/sp) x hidden x 2
bytes` of memory; with the host offload (offload.py) the kept outputs go to the host with the checkpoints, for the
layers placed there (levers/placement.py). model/surgery.py installs a function per layer: its place, and its segment
under `--checkpoint_every` (segments.py).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..sp.kernels import ATTENTION_OPS
from .offload import HostOffload, OffloadKeptOutputs
from .segments import SegmentChain


def _save_attention_outputs(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_contexts(offload: Optional[HostOffload]):
    forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(_save_attention_outputs)
    if offload is None:
        return forward_ctx, recompute_ctx
    return _Both(forward_ctx, OffloadKeptOutputs(forward_ctx, offload)), recompute_ctx


class _Both:
    """Enters two context managers in order and leaves them in reverse."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __enter__(self):
        self.first.__enter__()
        self.second.__enter__()

    def __exit__(self, *exc):
        self.second.__exit__(*exc)
        self.first.__exit__(*exc)


def make_checkpoint_fn(keep_attention: bool, offload: Optional[HostOffload],
                       segment: Optional[tuple[SegmentChain, int, bool]] = None):
    """The function transformers calls for a checkpointed layer (`_gradient_checkpointing_func`). `offload`: where
    what the layer saves goes (None: it stays on the GPU; model/surgery.py gives each layer its place,
    levers/placement.py); `segment`: (the model's chain, the layer's offset in its segment, whether it is the
    segment's last) under `--checkpoint_every` (segments.py), None for a checkpoint of its own."""
    kwargs = {"use_reentrant": False}
    if keep_attention:
        kwargs["context_fn"] = functools.partial(_keep_contexts, offload)

    def checkpoint_layer(function, *args, **kw):
        if offload is not None:
            offload.start_group()
        if segment is not None and torch.is_grad_enabled():
            chain, offset, last = segment
            hooks = chain.hooks(offset, last, function, args, offload)
        else:
            hooks = offload if offload is not None else contextlib.nullcontext()
        with hooks:
            return checkpoint(function, *args, **kwargs, **kw)
    return checkpoint_layer
