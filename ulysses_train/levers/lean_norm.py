"""RMSNorm that keeps less for its backward (`--lean_norm`, on by default).

The RMSNorms of transformers upcast their input to fp32 and autograd saves that fp32 copy, the normalised output and
the inverse RMS: 6 bytes per element for a bf16 model. Qwen3 applies one four times per layer (before attention,
before the MLP, and per head on q and k), Gemma 3 six, so the recomputed layer holds 6 x (2 x hidden + heads x
head_dim + kv_heads x head_dim) bytes per token in norms alone. This Function computes exactly the same forward
(the same ops in the same order, so the same bits) but saves the input in its own dtype and one fp32 inverse RMS
per row, and rebuilds the normalised values in the backward: 2 bytes per element. Liger-Kernel and Apex do the same
with fused kernels; this version stays in PyTorch ops so the numbers match transformers' bit for bit in the forward
and within rounding in the backward, on any device. On CUDA, `--fused_kernels` runs the same computation as one
Triton kernel each way (fused_kernels.rms_norm), installed by the same matching.

transformers' RMSNorms come in three arithmetics, each a `NormRule` (model/matching.py decides which one a module
computes, by running it; a norm computing none of them is left alone):

- Llama's (Qwen3, Qwen2, Mistral, Llama 4 ...): weight * (x * rstd).to(x.dtype), the product in the promoted dtype;
- T5's (OLMo 3, GPT-OSS): (weight * x * rstd).to(x.dtype), the product in fp32 and rounded once;
- zero-centred (Gemma 2 and 3, Qwen3.5, Qwen3-Next): ((1 + weight) * x * rstd).to(x.dtype), in fp32 likewise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NormRule:
    """How an RMSNorm scales its normalised values: weight + `offset`, and whether the normalised values are rounded
    to the input's dtype before the product (Llama's) or the product is taken in fp32 and rounded once."""
    offset: float = 0.0
    round_first: bool = True

    @property
    def name(self) -> str:
        return "llama" if self.round_first else ("zero-centred" if self.offset else "t5")


LLAMA, T5, ZERO_CENTRED = NormRule(), NormRule(round_first=False), NormRule(offset=1.0, round_first=False)
RULES = (LLAMA, T5, ZERO_CENTRED)


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rule: NormRule = LLAMA) -> torch.Tensor:
    """The rule's forward in transformers' own op order (the probes compare modules with it bit for bit)."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if rule.round_first:
        return weight * normed.to(x.dtype)
    scale = weight.float() + rule.offset if rule.offset else weight.float()
    return (normed * scale).to(x.dtype)


def reference_gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The gated RMSNorm of the Gated DeltaNet layers (transformers' `Qwen3_5RMSNormGated`, `Qwen3NextRMSNormGated`)
    in their op order: Llama's norm, times silu(gate) in fp32, rounded to x's dtype."""
    return (reference_norm(x, weight, eps, LLAMA) * torch.nn.functional.silu(gate.to(torch.float32))).to(x.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, rule: NormRule = LLAMA) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        ctx.rule = rule
        if rule.round_first:
            return weight * (x32 * rstd).to(x.dtype)
        scale = weight.float() + rule.offset if rule.offset else weight.float()
        return ((x32 * rstd) * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        rule = ctx.rule
        y32 = x.to(torch.float32) * rstd
        grad_weight = None
        if rule.round_first:
            if ctx.needs_input_grad[1]:
                grad_weight = (grad_out * y32.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
            g = (grad_out * weight).to(torch.float32)  # the gradient reaching the fp32 normalised values
        else:
            g32 = grad_out.to(torch.float32)
            if ctx.needs_input_grad[1]:
                grad_weight = (g32 * y32).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
            g = g32 * (weight.float() + rule.offset)
        grad_x = rstd * (g - y32 * (g * y32).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None, None


def norm_epsilon(module: torch.nn.Module) -> float:
    """The epsilon of a transformers RMSNorm module: `variance_epsilon` (Llama's spelling) or `eps` (Gemma's)."""
    eps = getattr(module, "variance_epsilon", None)
    return module.eps if eps is None else eps


def lean_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward of an RMSNorm module, lean (model/surgery.py installs it and sets `_norm_rule`)."""
    return _RMSNormFunction.apply(hidden_states, self.weight, norm_epsilon(self), self._norm_rule)
