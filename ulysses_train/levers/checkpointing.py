"""Activation checkpointing of every decoder layer, with kept attention outputs (`--attn_recompute never`).

Selective checkpointing that saves the attention kernel's outputs (the output and its log-sum-exp) in the forward,
so the recompute before a layer's backward re-runs everything except the kernel, the most expensive op at long
context (what keeping them saves: docs/benchmarks.md, "What each lever buys"); likewise a Gated DeltaNet layer's
recurrence where FLA runs it (its output and the two tensors its backward reads: sp/gated_delta_op.py). Costs about
`layers x (s/sp) x hidden x 2 bytes` of memory (policy.kept_output_bytes counts it per layer); with the host
offload (offload.py) the kept outputs go to the host with the checkpoints, for the layers placed there
(levers/placement.py). model/surgery.py installs a function per layer: its place, and its segment under
`--checkpoint_every` (segments.py).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..sp.kernels import ATTENTION_OPS, LINEAR_ATTENTION_OPS
from .offload import HostOffload, OffloadKeptOutputs
from .segments import SegmentChain


def kept_ops(keep_attention: bool, keep_linear: bool = False) -> frozenset:
    """The ops whose outputs a checkpointed layer keeps: the attention kernels', the gated delta rule's, or both."""
    return frozenset((ATTENTION_OPS if keep_attention else []) + (LINEAR_ATTENTION_OPS if keep_linear else []))


def _save_kept_outputs(ops: frozenset, ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_contexts(ops: frozenset, offload: Optional[HostOffload]):
    forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(functools.partial(_save_kept_outputs, ops))
    if offload is None:
        return forward_ctx, recompute_ctx
    return _Both(forward_ctx, OffloadKeptOutputs(forward_ctx, offload, ops)), recompute_ctx


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
                       segment: Optional[tuple[SegmentChain, int, bool]] = None, keep_linear: bool = False):
    """The function transformers calls for a checkpointed layer (`_gradient_checkpointing_func`), keeping the
    attention kernels' outputs (`keep_attention`) and the gated delta rule's (`keep_linear`). `offload`: where
    what the layer saves goes (None: it stays on the GPU; model/surgery.py gives each layer its place,
    levers/placement.py); `segment`: (the model's chain, the layer's offset in its segment, whether it is the
    segment's last) under `--checkpoint_every` (segments.py), None for a checkpoint of its own."""
    kwargs = {"use_reentrant": False}
    ops = kept_ops(keep_attention, keep_linear)
    if ops:
        kwargs["context_fn"] = functools.partial(_keep_contexts, ops, offload)

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
