"""FlashAttention-4 as two registered torch ops, `ulysses::fa4_fwd` and `ulysses::fa4_bwd`.

Why our own wrapper rather than `flash_attn.cute.flash_attn_func`: that function is a Python autograd Function whose
kernels are not ops the dispatcher sees, so selective checkpointing cannot keep its outputs and every checkpointed
layer runs the attention forward twice (`--attn_recompute never` had to fall back to recomputing). As a
registered op with an autograd formula, `fa4_fwd` is one op to the checkpoint's policy, which keeps its (out, lse)
like SDPA's, and to the offload, which moves them to the host. On the H200 FA4 runs forward+backward at 617-628
TFLOP/s against cuDNN's 541-552 at 64k-131k tokens (benchmarks/attn_bench.py, docs/benchmarks.md).

Layout (b, s, h, d) for q, k, v and out, lse (b, h, s) fp32; GQA native (k, v with fewer heads); causal.
Packed documents go through `ulysses::fa4_varlen_fwd` / `fa4_varlen_bwd`: q, k, v, out (total, h, d), lse (h, total),
documents given by `cu_seqlens` (int32, their start offsets and the total). One kernel call per layer for every
document, rather than one per document: the kept outputs then have the same shapes at every step, and a sample of
many short conversations does not pay a launch per conversation. The ring (ring.py) calls `IMPL` directly, causal or
not, for its blocks.
`IMPL` holds the kernel calls; the CPU tests swap in an exact reference to check the op plumbing (keeping,
offload, gradients) without the package or a GPU.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def _fa4_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> tuple[Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)[:2]
    return out, lse


def _fa4_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  scale: float, causal: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=causal)[:3]
    return dq, dk, dv


def _fa4_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                        scale: float) -> tuple[Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse = _flash_attn_fwd(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                               max_seqlen_k=max_seqlen, softmax_scale=scale, causal=True, return_lse=True)[:2]
    return out, lse


def _fa4_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
                         max_seqlen: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=True, cu_seqlens_q=cu_seqlens,
                                 cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)[:3]
    return dq, dk, dv


IMPL: dict[str, Callable] = {"forward": _fa4_forward, "backward": _fa4_backward,
                             "varlen_forward": _fa4_varlen_forward, "varlen_backward": _fa4_varlen_backward}


@torch.library.custom_op("ulysses::fa4_fwd", mutates_args=())
def fa4_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    return IMPL["forward"](q, k, v, scale)


@fa4_fwd.register_fake
def _fa4_fwd_fake(q, k, v, scale):
    b, s, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("ulysses::fa4_bwd", mutates_args=())
def fa4_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
            scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return IMPL["backward"](dout, q, k, v, out, lse, scale)


@fa4_bwd.register_fake
def _fa4_bwd_fake(dout, q, k, v, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale


def _backward(ctx, dout, _dlse):  # lse is an auxiliary output: nothing differentiates through it
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.ulysses.fa4_bwd(dout.contiguous(), q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


fa4_fwd.register_autograd(_backward, setup_context=_setup_context)



@torch.library.custom_op("ulysses::fa4_varlen_fwd", mutates_args=())
def fa4_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                   scale: float) -> tuple[Tensor, Tensor]:
    return IMPL["varlen_forward"](q, k, v, cu_seqlens, max_seqlen, scale)


@fa4_varlen_fwd.register_fake
def _fa4_varlen_fwd_fake(q, k, v, cu_seqlens, max_seqlen, scale):
    total, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((h, total), dtype=torch.float32)


@torch.library.custom_op("ulysses::fa4_varlen_bwd", mutates_args=())
def fa4_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
                   max_seqlen: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return IMPL["varlen_backward"](dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale)


@fa4_varlen_bwd.register_fake
def _fa4_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _varlen_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.ulysses.fa4_varlen_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_seqlen,
                                                  ctx.scale)
    return dq, dk, dv, None, None, None


fa4_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)

FORWARD_OP = torch.ops.ulysses.fa4_fwd.default
VARLEN_FORWARD_OP = torch.ops.ulysses.fa4_varlen_fwd.default


def fa4_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q (b, s, hq, d), k/v (b, s, hkv, d) -> (b, s, hq, d), causal."""
    return fa4_fwd(q, k, v, scale)[0]


def fa4_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> Tensor:
    """q (total, hq, d), k/v (total, hkv, d), documents at `cu_seqlens` -> (total, hq, d), causal in each."""
    return fa4_varlen_fwd(q, k, v, cu_seqlens, max_seqlen, scale)[0]


# ---------------------------------------------------------------- exact reference (CPU tests)


def _expand(t: Tensor, heads: int) -> Tensor:
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def _mask_future(scores: Tensor, causal: bool) -> Tensor:
    if not causal:
        return scores
    n, m = scores.shape[-2:]
    return scores.masked_fill(torch.ones(n, m, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))


def reference_forward(q, k, v, scale, causal=True):
    """What the kernel computes, in plain ops: (out, lse) in the kernel's layouts."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, _expand(k, q.shape[2]), _expand(v, q.shape[2])))  # (b, h, s, d)
    scores = _mask_future((qh @ kh.transpose(-1, -2)) * scale, causal)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    lse = torch.logsumexp(scores, dim=-1)  # (b, h, s), fp32 as the kernel's (fp64 in fp64 tests)
    out = (torch.exp(scores - lse[..., None]).to(q.dtype) @ vh).transpose(1, 2).contiguous()
    return out, lse


def reference_backward(dout, q, k, v, out, lse, scale, causal=True):
    """The analytic gradient of softmax attention from (out, lse), with GQA heads summed per KV head."""
    heads = q.shape[2]
    qh, kh, vh, oh, dh = (t.transpose(1, 2) for t in (q, _expand(k, heads), _expand(v, heads), out, dout))
    scores = _mask_future((qh @ kh.transpose(-1, -2)) * scale, causal)
    p = torch.exp(scores - lse[..., None])  # (b, h, s, s)
    dv = p.transpose(-1, -2) @ dh
    dp = dh @ vh.transpose(-1, -2)
    ds = p * (dp - (dh * oh).sum(-1, keepdim=True))
    dq, dk = (ds @ kh) * scale, (ds.transpose(-1, -2) @ qh) * scale

    def per_kv(t, kv_heads):  # (b, h, s, d) -> (b, s, kv, d), summing each KV head's query heads
        b, h, n, d = t.shape
        return t.reshape(b, kv_heads, h // kv_heads, n, d).sum(2).transpose(1, 2).contiguous()

    return dq.transpose(1, 2).contiguous(), per_kv(dk, k.shape[2]), per_kv(dv, v.shape[2])


def reference_varlen_forward(q, k, v, cu_seqlens, max_seqlen, scale):
    """The varlen kernel in plain ops: each document through `reference_forward`; lse (h, total)."""
    outs, lses = [], []
    for a, b in zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist()):
        out, lse = reference_forward(q[None, a:b], k[None, a:b], v[None, a:b], scale)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def reference_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    grads = [reference_backward(dout[None, a:b], q[None, a:b], k[None, a:b], v[None, a:b], out[None, a:b],
                                lse[None, :, a:b], scale)
             for a, b in zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())]
    return tuple(torch.cat([g[i][0] for g in grads]) for i in range(3))


REFERENCE_IMPL = {"forward": reference_forward, "backward": reference_backward,
                  "varlen_forward": reference_varlen_forward, "varlen_backward": reference_varlen_backward}
