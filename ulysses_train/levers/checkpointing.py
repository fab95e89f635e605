"""Activation checkpointing of every decoder layer, with kept attention outputs (`--attn_recompute never`).

Selective checkpointing that saves the attention kernel's outputs (the output and its log-sum-exp) in the forward,
so the recompute before a layer's backward re-runs everything except the kernel, the most expensive op at long
context (what keeping them saves: docs/benchmarks.md, "What each lever buys"). Costs `layers x (s/sp) x hidden x 2 bytes` of memory; with the host offload
(offload.py) the kept outputs go to the host with the checkpoints. model/surgery.py installs the function on the
model's layers.
"""

from __future__ import annotations

import functools
from typing import Optional

from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..sp.kernels import ATTENTION_OPS
from .offload import HostOffload, OffloadKeptOutputs


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


def make_checkpoint_fn(keep_attention: bool, offload: Optional[HostOffload]):
    """The function transformers calls for each checkpointed layer (`_set_gradient_checkpointing`)."""
    kwargs = {"use_reentrant": False}
    if keep_attention:
        kwargs["context_fn"] = functools.partial(_keep_contexts, offload)

    def checkpoint_layer(function, *args, **kw):
        if offload is None:
            return checkpoint(function, *args, **kwargs, **kw)
        offload.start_group()
        with offload:
            return checkpoint(function, *args, **kwargs, **kw)
    return checkpoint_layer
