"""The self-check our fused kernels pass on the device before a run uses them (`--fused_kernels`): each kernel,
forward and backward, against the PyTorch ops it replaces, on small random inputs that cover its edges. A kernel
that fails to compile or disagrees means transformers' ops under `auto` (the reason logged) and an error under
`on` (model/surgery.py decides)."""

from __future__ import annotations

from typing import Optional

import torch

from .fused_kernels import GatedMulFunction, RotaryFunction, gated_rms_norm, rms_norm


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| in fp64 (a zero reference counts as tiny, so any difference shows)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _check_cases(device: torch.device, dtype: torch.dtype):
    """(name, fused op, the PyTorch ops it replaces, leaves) on small random inputs that cover the kernels' edges:
    two row blocks of a norm (Llama's, zero-centred, gated by a strided gate), strided q with fewer rows than heads x
    dims, a partly masked gated-MLP block (silu and tanh GELU)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from .lean_norm import ZERO_CENTRED, _RMSNormFunction, reference_gated_norm

    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()

    x, w, q, gate, up = leaf(3, 40, 96), leaf(96), leaf(2, 24, 4, 16), leaf(3, 700), leaf(3, 700)
    z = leaf(3, 40, 2, 96)  # the gate, read every other row as a view
    angles = torch.rand(1, 24, 8, generator=g) * 24
    cos, sin = (f(torch.cat([angles, angles], -1)).to(device, dtype) for f in (torch.cos, torch.sin))
    return [("rms_norm", lambda: rms_norm(x, w, 1e-6), lambda: _RMSNormFunction.apply(x, w, 1e-6), (x, w)),
            ("rms_norm (1 + weight)", lambda: rms_norm(x, w, 1e-6, ZERO_CENTRED),
             lambda: _RMSNormFunction.apply(x, w, 1e-6, ZERO_CENTRED), (x, w)),
            ("gated rms_norm", lambda: gated_rms_norm(x, z[:, :, 0], w, 1e-6),
             lambda: reference_gated_norm(x, z[:, :, 0], w, 1e-6), (x, z, w)),
            ("rotary", lambda: RotaryFunction.apply(q.transpose(1, 2), cos, sin),
             lambda: apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)[0], (q,)),
            ("silu_mul", lambda: GatedMulFunction.apply(gate, up), lambda: torch.nn.functional.silu(gate) * up,
             (gate, up)),
            ("gelu_tanh_mul", lambda: GatedMulFunction.apply(gate, up, "gelu_tanh"),
             lambda: torch.nn.functional.gelu(gate, approximate="tanh") * up, (gate, up))]


def self_check(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Runs each kernel forward and backward on `device` and compares it with the PyTorch ops it replaces; returns
    what failed or disagreed, None when all agree (to 1e-4 in fp32; to 3e-2 in bf16, a few of its 2^-8 steps)."""
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    try:
        for name, fused, reference, leaves in _check_cases(device, dtype):
            got, want = fused(), reference()
            grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
            pairs = zip((got, *torch.autograd.grad(got, leaves, grad)),
                        (want, *torch.autograd.grad(want, leaves, grad)))
            for what, (a, b) in zip(("output", *(f"gradient {i}" for i in range(len(leaves)))), pairs):
                err = rel_err(a, b)
                if not err <= tol:  # NaN fails too
                    return f"{name}'s {what} differs from PyTorch's by {err:.1e} (tolerance {tol:.0e})"
    except Exception as e:  # a kernel that does not compile or launch here
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    return None
