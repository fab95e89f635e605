"""The chunked gated delta rule of flash-linear-attention as two registered torch ops, `ulysses::gated_delta_fwd`
and `ulysses::gated_delta_bwd`, so that checkpointing can keep its outputs (`--linear_recompute never`).

Why our own wrapper rather than `fla.ops.gated_delta_rule.chunk_gated_delta_rule`: that is a Python autograd Function
whose Triton kernels the dispatcher never sees, so selective checkpointing cannot keep what it computed, and every
checkpointed Gated DeltaNet layer runs the recurrence forward twice (once in the forward, once in the recompute
before its backward). As one registered op with an autograd formula it is one op to the checkpoint's policy
(levers/checkpointing.py), which keeps its outputs like an attention kernel's, and to the offload, which moves them to
the host. It is the same arithmetic as FLA's Function, call for call: `chunk_gated_delta_rule_fwd` in the forward,
`chunk_gated_delta_rule_bwd` in the backward, with what FLA's Function saves between them.

    q, k (b, s, hk, dk) already L2-normalised, v (b, s, hv, dv), g (b, s, hv) fp32 log-decay, beta (b, s, hv)
    -> o (b, s, hv, dv); kept beside it: the decay's chunk-local cumulative sum (b, s, hv) fp32 and the WY
    representation's inverted block A (b, s, hv, 64), which the backward needs

The L2 normalisation of q and k (transformers' `use_qk_l2norm_in_kernel=True`) runs before the op, as FLA's own
`l2norm` Function (the same kernels FLA's rule runs inside itself), so the recompute re-runs it (cheap) and the op's
backward stays FLA's. What is kept costs per token and layer (dv + 64) x hv x 2 + 4 x hv bytes: 12.1 KiB for
Qwen3.5-9B's 32 value heads, against 8 KiB of attention output for its attention layers.

Packed documents come as `cu_seqlens` (int64 starts and the total, over the batch flattened to one row).
`IMPL` holds the kernel calls; the CPU tests swap in `REFERENCE_IMPL` (transformers' torch rule, per document) to
check the plumbing (keeping, offload, gradients) without FLA or a GPU.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

CHUNK = 64  # FLA's chunk: the A block is (b, s, hv, CHUNK)


def _fla_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                 cu_seqlens: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    g_cumsum, o, a, _, _, _ = chunk_gated_delta_rule_fwd(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=None, output_final_state=False,
        cu_seqlens=cu_seqlens, chunk_indices=_chunk_indices(cu_seqlens), chunk_size=CHUNK)
    return o.to(q.dtype), g_cumsum, a


def _fla_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, g_cumsum: Tensor, beta: Tensor, a: Tensor,
                  scale: float, cu_seqlens: Optional[Tensor]) -> tuple[Tensor, ...]:
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    dq, dk, dv, dbeta, dg, _, _, _ = chunk_gated_delta_rule_bwd(
        q=q, k=k, v=v, g=g_cumsum, beta=beta, A=a, scale=scale, initial_state=None, do=do, dht=None,
        cu_seqlens=cu_seqlens, chunk_indices=_chunk_indices(cu_seqlens), chunk_size=CHUNK)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g_cumsum.dtype), dbeta.to(beta.dtype)


def _chunk_indices(cu_seqlens: Optional[Tensor]) -> Optional[Tensor]:
    if cu_seqlens is None:
        return None
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(cu_seqlens, CHUNK)


def fla_l2norm(x: Tensor) -> Tensor:
    """FLA's L2 normalisation over the last dimension (its autograd Function), the one its rule runs inside itself
    with `use_qk_l2norm_in_kernel=True`."""
    from fla.modules.norm.l2norm import l2norm

    return l2norm(x)


IMPL: dict[str, Callable] = {"forward": _fla_forward, "backward": _fla_backward, "normalize": fla_l2norm}


@torch.library.custom_op("ulysses::gated_delta_fwd", mutates_args=())
def gated_delta_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                    cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(t.contiguous() for t in IMPL["forward"](q.contiguous(), k.contiguous(), v.contiguous(),
                                                         g.contiguous(), beta.contiguous(), scale, cu_seqlens))


@gated_delta_fwd.register_fake
def _gated_delta_fwd_fake(q, k, v, g, beta, scale, cu_seqlens=None):
    b, s, hv, _ = v.shape
    return torch.empty_like(v), g.new_empty((b, s, hv), dtype=torch.float32), k.new_empty((b, s, hv, CHUNK))


@torch.library.custom_op("ulysses::gated_delta_bwd", mutates_args=())
def gated_delta_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, g_cumsum: Tensor, beta: Tensor, a: Tensor,
                    scale: float, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    grads = IMPL["backward"](do.contiguous(), q, k, v, g_cumsum, beta, a, scale, cu_seqlens)
    return tuple(t.contiguous() for t in grads)


@gated_delta_bwd.register_fake
def _gated_delta_bwd_fake(do, q, k, v, g_cumsum, beta, a, scale, cu_seqlens=None):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g_cumsum),
            torch.empty_like(beta))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, cu_seqlens = inputs
    _, g_cumsum, a = output
    ctx.save_for_backward(q, k, v, g_cumsum, beta, a, *([cu_seqlens] if cu_seqlens is not None else []))
    ctx.scale, ctx.g_dtype = scale, g.dtype


def _backward(ctx, do, _dg_cumsum, _da):  # the kept auxiliaries: nothing differentiates through them
    q, k, v, g_cumsum, beta, a, *cu = ctx.saved_tensors
    dq, dk, dv, dg, dbeta = torch.ops.ulysses.gated_delta_bwd(do.contiguous(), q, k, v, g_cumsum, beta, a, ctx.scale,
                                                              cu[0] if cu else None)
    return dq, dk, dv, dg.to(ctx.g_dtype), dbeta, None, None


gated_delta_fwd.register_autograd(_backward, setup_context=_setup_context)

FORWARD_OP = torch.ops.ulysses.gated_delta_fwd.default


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """transformers' `chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)` without a state:
    q, k (b, s, hk, dk), v (b, s, hv, dv) with hv a multiple of hk, g, beta (b, s, hv) -> (b, s, hv, dv); with
    `cu_seqlens` (b must be 1) the recurrence restarts at every document."""
    normalize, scale = IMPL["normalize"], q.shape[-1] ** -0.5
    return gated_delta_fwd(normalize(q), normalize(k), v, g, beta, scale, cu_seqlens)[0]


# ---------------------------------------------------------------- exact reference (CPU tests)


def torch_l2norm(x: Tensor) -> Tensor:
    """transformers' l2norm (its modeling files' `l2norm`, eps 1e-6): the reference's normalisation."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _documents(length: int, cu_seqlens: Optional[Tensor]) -> list[tuple[int, int]]:
    bounds = [0, length] if cu_seqlens is None else cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _reference_rule(q, k, v, g, beta, cu_seqlens):
    """transformers' torch rule (Qwen3.5's modeling file), each document alone: (b, s, hv, dv)."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    group = v.shape[2] // q.shape[2]
    q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
    pieces = [rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False)[0]
              for a, b in _documents(q.shape[1], cu_seqlens)]
    return torch.cat(pieces, dim=1).to(v.dtype)


def reference_forward(q, k, v, g, beta, scale, cu_seqlens=None):
    """The op in plain torch: the output, the decay as given (standing in for its cumulative sum) and an empty A."""
    assert abs(scale - q.shape[-1] ** -0.5) < 1e-12, "the torch rule scales by dk ** -0.5"
    out = _reference_rule(q, k, v, g, beta, cu_seqlens)
    return out, g.float().clone(), k.new_zeros((*v.shape[:3], CHUNK))


def reference_backward(do, q, k, v, g_cumsum, beta, a, scale, cu_seqlens=None):
    """Gradients of `reference_forward` on a recompute, through torch.func (an op's implementation runs below
    autograd, which torch.func's transform does not need)."""
    inputs = (q, k, v, g_cumsum, beta)
    _, vjp = torch.func.vjp(lambda *x: _reference_rule(*x, cu_seqlens), *inputs)
    return tuple(grad.to(t.dtype) for grad, t in zip(vjp(do), inputs))


REFERENCE_IMPL = {"forward": reference_forward, "backward": reference_backward, "normalize": torch_l2norm}
