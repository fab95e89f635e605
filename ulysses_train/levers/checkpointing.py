"""Activation checkpointing of every decoder layer, with kept attention outputs (`--attn_recompute never`).

Checkpointing that saves the attention kernel's outputs (the output and its log-sum-exp) in the forward,
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
from collections import defaultdict
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from ..sp.kernels import ATTENTION_OPS, LINEAR_ATTENTION_OPS
from .offload import HostOffload, OffloadKeptOutputs
from .projections import PROJECTION_OPS, is_kept
from .segments import SegmentChain


def kept_ops(keep_attention: bool, keep_linear: bool = False, keep_projections: bool = False) -> frozenset:
    """The ops whose outputs a checkpointed layer keeps: the attention kernels', the gated delta rule's, and the
    matmuls of its marked projections (projections.py), as asked."""
    return frozenset((ATTENTION_OPS if keep_attention else []) + (LINEAR_ATTENTION_OPS if keep_linear else [])
                     + (list(PROJECTION_OPS) if keep_projections else []))


class KeptOutput:
    """One kept tensor, read back through `get_val` (the interface the offload's host copies share). A tensor changed
    in place after it was stored (an op of the forward writing into a kept op's output) would hand the recompute the
    changed values: that is an error, not a silent wrong gradient."""

    def __init__(self, val: torch.Tensor):
        # the op's own output carries the version counter the forward's later ops bump (a detached alias made
        # below autograd, which is what is kept, does not share it)
        self.val, self.source, self.version = val.detach(), val, val._version

    def get_val(self, allow_cache_entry_mutation: bool = False) -> torch.Tensor:
        if self.source._version != self.version:
            raise RuntimeError(f"a kept output ({tuple(self.val.shape)}) was changed in place after the forward stored "
                               f"it; its recompute would read the changed values (levers/checkpointing.py: turn off "
                               f"the lever that keeps it: --keep_projections, --attn_recompute, --linear_recompute)")
        return self.val


class KeepOutputs(TorchDispatchMode):
    """The checkpoint's forward: every op runs; the outputs of the kept ops are stored per op, in call order.

    Why not torch's selective checkpointing (`create_selective_checkpoint_contexts` with a MUST_SAVE policy): from
    torch 2.13 it records every op of the region and requires the recompute to issue the same sequence, and ZeRO-3
    gathers parameters inside the region (module hooks, a DeltaNet layer's conv weight read directly) as its prefetch
    allows, differently in the forward and in the recompute: the recompute then fails on an `aten.cat` the forward
    did not run. Only the kept ops' order matters, and nothing but the layer calls them."""

    def __init__(self, ops: frozenset, storage: dict):
        super().__init__()
        self.ops, self.storage = ops, storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_kept(func, self.ops):
            self.storage[func].append(tree_map(lambda x: KeptOutput(x) if isinstance(x, torch.Tensor) else x, out))
        return out


class UseKeptOutputs(TorchDispatchMode):
    """The checkpoint's recompute: every op runs again but the kept ones, whose stored outputs come back in order."""

    def __init__(self, ops: frozenset, storage: dict):
        super().__init__()
        self.ops, self.storage = ops, storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not is_kept(func, self.ops):
            return func(*args, **(kwargs or {}))
        if not self.storage[func]:
            raise RuntimeError(f"the recompute of a checkpointed layer calls {func} more often than its forward did "
                               f"(levers/checkpointing.py keeps one output per call)")
        return tree_map(lambda x: x.get_val() if hasattr(x, "get_val") else x, self.storage[func].pop(0))


def _keep_contexts(ops: frozenset, offload: Optional[HostOffload]):
    storage = defaultdict(list)
    forward_ctx, recompute_ctx = KeepOutputs(ops, storage), UseKeptOutputs(ops, storage)
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
                       segment: Optional[tuple[SegmentChain, int, bool]] = None, keep_linear: bool = False,
                       keep_projections: bool = False):
    """The function transformers calls for a checkpointed layer (`_gradient_checkpointing_func`), keeping the
    attention kernels' outputs (`keep_attention`), the gated delta rule's (`keep_linear`) and its marked
    projections' (`keep_projections`: projections.py marks the layer's modules). `offload`: where
    what the layer saves goes (None: it stays on the GPU; model/surgery.py gives each layer its place,
    levers/placement.py); `segment`: (the model's chain, the layer's offset in its segment, whether it is the
    segment's last) under `--checkpoint_every` (segments.py), None for a checkpoint of its own."""
    kwargs = {"use_reentrant": False}
    ops = kept_ops(keep_attention, keep_linear, keep_projections)
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
