"""Buffers keep the dtype and values plain transformers gives them, whatever DeepSpeed did while building the model.

Why this exists: under ZeRO-3 transformers builds the model inside DeepSpeed's `zero.Init`, which replaces
`torch.arange`, `torch.zeros`, `torch.empty`, `torch.tensor`, ... with wrappers that turn every floating tensor they
create into the training dtype (`deepspeed/runtime/zero/partition_parameters.py`,
`zero_wrapper_for_fp_tensor_constructor`, applied in `Init._add_tensor_creation_wrappers`). The rotary embedding
computes `inv_freq` from `torch.arange(0, dim, 2, dtype=torch.float)`, so in bf16 its frequencies are rounded to
8 bits: up to 0.37% off for Qwen3 (theta 1e6, head_dim 128), which at distance 32k turns 28 of the 64 frequency
pairs by more than 0.1 rad. A model fine-tuned so learns frequencies its exported copy never uses (transformers
computes them in fp32 on load). Later transformers releases wrap the call in `prevent_arange_dtype_change`
(5.17, the release on our GPU machine, does not; 5.24 does), which is why the fault showed on the GPU and not in
CPU tests with a newer transformers: it depends on the transformers release, not on the accelerator. DeepSpeed's
own `data_types.keep_in_fp32_modules` only names buffers in transformers' `_keep_in_fp32_modules_strict` lists
(MoE routing biases), and converts their dtype back without recomputing the values, which are already rounded.

So after the model is built (and again after `deepspeed.initialize`, in case an engine version casts buffers),
every module that owns floating buffers and can be rebuilt from its `config` alone (every rotary embedding of
transformers: default, YaRN, linear, dynamic, llama3, longrope) is rebuilt outside `zero.Init`, as plain
transformers builds it, and each buffer whose dtype or value differs is replaced by the fresh one. Buffers of
modules that cannot be rebuilt that way are reported, never silently trusted.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class BufferReport:
    restored: list[str] = field(default_factory=list)  # "name (dtype -> dtype)" of each buffer replaced
    unchecked: list[str] = field(default_factory=list)  # non-fp32 floating buffers of modules we cannot rebuild

    def describe(self) -> str:
        parts = []
        if self.restored:
            parts.append(f"restored to plain transformers' values: {', '.join(self.restored)}")
        if self.unchecked:
            parts.append(f"not checked (their module cannot be rebuilt from its config): {', '.join(self.unchecked)}")
        return "; ".join(parts) or "all as plain transformers builds them"


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """What transformers' `from_config(dtype=...)` sets while it builds a model."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _rebuild(module: nn.Module) -> nn.Module | None:
    """A fresh copy of `module` built from its config on the CPU, or None when its class needs more than that (or
    owns parameters, which a rebuild would allocate for nothing)."""
    config = getattr(module, "config", None)
    if config is None or any(True for _ in module.parameters()):
        return None
    required = [p for p in list(inspect.signature(type(module).__init__).parameters.values())[1:]
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(required) != 1:
        return None
    try:
        return type(module)(config)
    except Exception:  # noqa: BLE001 - its one argument is not a config after all: its buffers go unchecked
        return None


def restore_fp32_buffers(model: nn.Module, dtype: torch.dtype) -> BufferReport:
    """Replaces every floating buffer that differs from what plain transformers computes (building the model in
    `dtype`) by that value, on the buffer's device. Idempotent; call outside `zero.Init`."""
    report = BufferReport()
    for prefix, module in model.named_modules():
        floating = {n: b for n, b in module.named_buffers(recurse=False) if b is not None and b.is_floating_point()}
        if not floating:
            continue
        with _default_dtype(dtype):
            fresh = _rebuild(module)
        for name, buf in floating.items():
            full = f"{prefix}.{name}" if prefix else name
            want = None if fresh is None else getattr(fresh, name, None)
            if not isinstance(want, torch.Tensor):
                if buf.dtype != torch.float32:
                    report.unchecked.append(f"{full} ({_short(buf.dtype)})")
                continue
            if want.dtype == buf.dtype and torch.equal(want.to(buf.device), buf):
                continue
            setattr(module, name, want.to(buf.device))  # stays a buffer, persistent or not as before
            report.restored.append(f"{full} ({_short(buf.dtype)} -> {_short(want.dtype)})")
        if fresh is not None and hasattr(fresh, "attention_scaling"):
            module.attention_scaling = fresh.attention_scaling
    return report


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
