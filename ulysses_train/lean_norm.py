"""RMSNorm that keeps less for its backward (`--lean_norm`, on by default).

The Llama-style RMSNorm of transformers (Qwen3, Qwen2, Llama, Mistral, ... copy it) upcasts its input to fp32 and
autograd saves that fp32 copy, the bf16 normalised output and the inverse RMS: 6 bytes per element for a bf16
model. Qwen3 applies it four times per layer (before attention, before the MLP, and per head on q and k), so the
recomputed layer holds 6 x (2 x hidden + heads x head_dim + kv_heads x head_dim) bytes per token in norms alone.
This Function computes exactly the same forward (the same ops in the same order, so the same bits) but saves the
input in its own dtype and one fp32 inverse RMS per row, and rebuilds the normalised values in the backward:
2 bytes per element. Liger-Kernel and Apex do the same with fused kernels; this version stays in PyTorch ops so the
numbers match transformers' bit for bit in the forward and within rounding in the backward, on any device. On CUDA,
`--fused_kernels` runs the same computation as one Triton kernel each way (fused_kernels.rms_norm), installed by
the same matching below.

Only modules whose `forward` is transformers' Llama RMSNorm, byte code for byte code, are replaced; any other
norm (Gemma's 1 + weight, OLMo's, ...) is left alone.
"""

from __future__ import annotations

import torch
from torch import nn


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        y32 = x.to(torch.float32) * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_out * y32.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g = (grad_out * weight).to(torch.float32)  # the gradient reaching the fp32 normalised values
        grad_x = rstd * (g - y32 * (g * y32).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


def _lean_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return _RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def _fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    from .fused_kernels import rms_norm

    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


_LEAN_CLASSES: dict[tuple[type, bool], type] = {}


def install_lean_norms(model: nn.Module, fused: bool = False) -> int:
    """Swaps every Llama-style RMSNorm in `model` for the lean one (in place); returns how many were swapped.
    fused: the same computation as one Triton kernel each way (fused_kernels.rms_norm, `--fused_kernels`)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from .fused_patch import code_key

    reference, swapped = code_key(LlamaRMSNorm.forward), 0
    for module in model.modules():
        cls = type(module)
        if cls in _LEAN_CLASSES.values():
            continue
        if not hasattr(module, "variance_epsilon") or code_key(cls.forward) != reference:
            continue
        if (cls, fused) not in _LEAN_CLASSES:
            prefix, forward = ("Fused", _fused_forward) if fused else ("Lean", _lean_forward)
            _LEAN_CLASSES[cls, fused] = type(f"{prefix}{cls.__name__}", (cls,), {"forward": forward})
        module.__class__ = _LEAN_CLASSES[cls, fused]
        swapped += 1
    return swapped
