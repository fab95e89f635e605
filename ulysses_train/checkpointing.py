"""Activation checkpointing of every decoder layer, with two levers of our own.

* Kept attention outputs (`--attn_recompute never`): selective checkpointing that saves the attention kernel's
  outputs (the output and its log-sum-exp) in the forward, so the recompute before a layer's backward re-runs
  everything except the kernel, the most expensive op at long context (~22% of a step at 64k+). Costs
  `layers x (s/sp) x hidden x 2 bytes` of memory.
* Host offload of checkpoints (`--offload_activations`): what a checkpointed layer saves (its inputs) goes to
  pinned host memory on a side stream in the forward, and comes back on a side stream one layer ahead of the
  backward that needs it, so both copies overlap compute. transformers' own `offload=True` copies on the compute
  stream and waits for each copy, which is why we write this one.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# attention kernels whose outputs are kept; the list covers every SDPA backend and the flash_attn package
_ATTENTION_OPS = [getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name)]
try:
    _ATTENTION_OPS.append(torch.ops.flash_attn._flash_attn_forward.default)
except (AttributeError, RuntimeError):
    pass

OFFLOAD_MIN_BYTES = 1 << 20  # small tensors are not worth a copy


def _keep_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of the forward go to pinned host memory; the backward gets them back one ahead of use.

    Backward unpacks in reverse order of packing, so when item k is unpacked we start copying item k-1 back."""

    def __init__(self, min_bytes: int = OFFLOAD_MIN_BYTES):
        self.min_bytes = min_bytes
        self.items: list[dict] = []
        self.d2h = torch.cuda.Stream()
        self.h2d = torch.cuda.Stream()
        self.host_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if not t.is_cuda or t.numel() * t.element_size() < self.min_bytes:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.d2h.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.d2h):
            host.copy_(t, non_blocking=True)
            t.record_stream(self.d2h)  # the allocator must not reuse t's memory before the copy is done
        item = {"host": host, "device": t.device, "index": len(self.items), "done_d2h": self.d2h.record_event()}
        self.items.append(item)
        self.host_bytes += host.numel() * host.element_size()
        return item

    def _fetch(self, item: dict) -> None:
        if "gpu" in item:
            return
        self.h2d.wait_event(item["done_d2h"])
        with torch.cuda.stream(self.h2d):
            item["gpu"] = item["host"].to(item["device"], non_blocking=True)
            item["done_h2d"] = self.h2d.record_event()

    def _unpack(self, item):
        if isinstance(item, torch.Tensor):
            return item
        self._fetch(item)
        if item["index"] > 0:
            self._fetch(self.items[item["index"] - 1])  # prefetch the one the backward needs next
        torch.cuda.current_stream().wait_event(item["done_h2d"])
        gpu = item.pop("gpu")
        gpu.record_stream(torch.cuda.current_stream())
        return gpu

    def reset(self) -> None:
        self.items.clear()
        self.host_bytes = 0


def make_checkpoint_fn(keep_attention: bool, offload: Optional[HostOffload]):
    """The function transformers calls for each checkpointed layer (`_set_gradient_checkpointing`)."""
    kwargs = {"use_reentrant": False}
    if keep_attention:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_attention)

    def checkpoint_layer(function, *args, **kw):
        if offload is None:
            return checkpoint(function, *args, **kwargs, **kw)
        with offload:
            return checkpoint(function, *args, **kwargs, **kw)
    return checkpoint_layer


def enable_checkpointing(model, keep_attention: bool, offload: Optional[HostOffload]) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # replace the checkpoint function transformers installed with ours, on every layer that has one
    fn = make_checkpoint_fn(keep_attention, offload)
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = fn
