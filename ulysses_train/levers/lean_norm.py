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
the same matching.

Only modules that compute transformers' Llama RMSNorm are replaced (model/matching.py); any other norm (Gemma's
1 + weight, OLMo's, ...) is left alone.
"""

from __future__ import annotations

import torch


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


def lean_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward of a Llama-style RMSNorm module, lean (model/surgery.py installs it)."""
    return _RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The same as one Triton kernel each way (`--fused_kernels`)."""
    from .fused_kernels import rms_norm

    return rms_norm(hidden_states, self.weight, self.variance_epsilon)
