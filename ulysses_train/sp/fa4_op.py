"""FlashAttention-4 as two registered torch ops, `ulysses::fa4_fwd` and `ulysses::fa4_bwd`.

Why our own wrapper rather than `flash_attn.cute.flash_attn_func`: that function is a Python autograd Function whose
kernels are not ops the dispatcher sees, so selective checkpointing cannot keep its outputs and every checkpointed
layer runs the attention forward twice (`--attn_recompute never` had to fall back to recomputing). As a
registered op with an autograd formula, `fa4_fwd` is one op to the checkpoint's policy, which keeps its (out, lse)
like SDPA's, and to the offload, which moves them to the host. Its speed against cuDNN's: docs/benchmarks.md
("Attention kernels", benchmarks/attn_bench.py). Where cuDNN's backward is the faster one (plain causal attention at
head_dim 256 on Hopper: `cudnn_backward_is_faster`), `fa4_bwd` runs it from FA4's forward outputs, a pairing no
caller of either library alone gets.

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

import functools
from typing import Callable, Optional

import torch
from torch import Tensor


def _window_args(window_left: int) -> dict:
    """FA4's local-window arguments for a causal window of `window_left + 1` keys (-1: none)."""
    return {} if window_left < 0 else {"window_size_left": window_left, "window_size_right": 0}


def _sink_grad(grads: tuple, sink) -> Tensor:
    """The sinks' gradient FA4 returns after dq, dk, dv when it was given sinks; an empty tensor otherwise."""
    return grads[3] if sink is not None else grads[0].new_empty(0)


def _fa4_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True, window_left: int = -1,
                 softcap: float = 0.0, sink=None) -> tuple[Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True, softcap=softcap or None,
                               learnable_sink=sink, **_window_args(window_left))[:2]
    return out, lse


def cudnn_backward_is_faster(head_dim: int, head_dim_v: int, causal: bool, window_left: int, softcap: float,
                             has_sink: bool, capability: tuple[int, int]) -> bool:
    """Whether cuDNN's attention backward runs this call faster than FA4's: plain causal attention at head_dim 256
    on Hopper (compute capability 9.0). There FA4's backward runs 64 x 48 tiles (its interface's SM90 tile table),
    315 TFLOP/s against cuDNN's 372-381 at 65,536 tokens on one H100 with Qwen3.5's 16 query and 4 KV heads, while
    FA4's forward is the faster one (738 against 643): benchmarks/attn_bench.py, docs/benchmarks.md ("Attention
    kernels"). Windows, softcaps and sinks stay FA4's: cuDNN's SDPA skips no blocks for a window and has neither."""
    return (causal and window_left < 0 and not softcap and not has_sink and head_dim == head_dim_v == 256
            and tuple(capability) == (9, 0))


@functools.lru_cache(maxsize=None)
def cudnn_lse_dims() -> int:
    """The dims of the log-sum-exp this PyTorch's cuDNN attention returns, and so takes back in its backward: (b, h, s,
    1) in some releases, (b, h, s) in others; asked of the op's meta kernel once."""
    q = torch.empty(1, 1, 8, 8, device="meta", dtype=torch.bfloat16)
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True, 0.0, True, False,
                                                              scale=1.0)[1].dim()


def as_cudnn_stats(lse: Tensor) -> Tensor:
    """A (b, h, s) log-sum-exp in the dims cuDNN's attention backward takes (cudnn_lse_dims); block_kernels.py's
    cuDNN backward hands its lse back through this too."""
    return lse.unsqueeze(-1) if cudnn_lse_dims() == 4 else lse


def _cudnn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float) -> tuple:
    """cuDNN's causal attention backward (PyTorch's op) from FA4's forward outputs: both keep the natural-log
    log-sum-exp of the scaled scores per query row, so FA4's (b, h, s) lse is cuDNN's (b, h, s, 1) statistics.
    (b, s, h, d) tensors go in as (b, h, s, d) views; GQA native (k, v with fewer heads)."""
    unused = torch.zeros(1, dtype=torch.int64, device=q.device)  # dropout's philox seed and offset: p = 0
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        *(t.transpose(1, 2) for t in (dout, q, k, v, out)), as_cudnn_stats(lse), unused, unused, None, None, None,
        q.shape[1], k.shape[1], 0.0, True, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), q.new_empty(0)


def _fa4_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                  causal: bool = True, window_left: int = -1, softcap: float = 0.0, sink=None) -> tuple:
    if cudnn_backward_is_faster(q.shape[-1], v.shape[-1], causal, window_left, softcap, sink is not None,
                                torch.cuda.get_device_capability(q.device)):
        return _cudnn_backward(dout, q, k, v, out, lse, scale)
    from flash_attn.cute.interface import _flash_attn_bwd

    grads = _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=causal, softcap=softcap,
                            learnable_sink=sink, **_window_args(window_left))
    return grads[0], grads[1], grads[2], _sink_grad(grads, sink)


def _fa4_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float,
                        window_left: int = -1, softcap: float = 0.0, sink=None) -> tuple[Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse = _flash_attn_fwd(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                               max_seqlen_k=max_seqlen, softmax_scale=scale, causal=True, return_lse=True,
                               softcap=softcap or None, learnable_sink=sink, **_window_args(window_left))[:2]
    return out, lse


def _fa4_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
                         max_seqlen: int, scale: float, window_left: int = -1, softcap: float = 0.0,
                         sink=None) -> tuple:
    from flash_attn.cute.interface import _flash_attn_bwd

    grads = _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=True, cu_seqlens_q=cu_seqlens,
                            cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                            softcap=softcap, learnable_sink=sink, **_window_args(window_left))
    return grads[0], grads[1], grads[2], _sink_grad(grads, sink)


IMPL: dict[str, Callable] = {"forward": _fa4_forward, "backward": _fa4_backward,
                             "varlen_forward": _fa4_varlen_forward, "varlen_backward": _fa4_varlen_backward}

# Every op takes a layer's pattern (sp/patterns.py) as window_left (keys before the query, -1: no window), softcap
# (0: none) and sink (the per-head sink logits, or None); the backward ops return the sinks' gradient after dv
# (an empty tensor without sinks).


@torch.library.custom_op("ulysses::fa4_fwd", mutates_args=())
def fa4_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, window_left: int = -1, softcap: float = 0.0,
            sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return IMPL["forward"](q, k, v, scale, True, window_left, softcap, sink)


@fa4_fwd.register_fake
def _fa4_fwd_fake(q, k, v, scale, window_left=-1, softcap=0.0, sink=None):
    b, s, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("ulysses::fa4_bwd", mutates_args=())
def fa4_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
            window_left: int = -1, softcap: float = 0.0,
            sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.contiguous() for t in IMPL["backward"](dout, q, k, v, out, lse, scale, True, window_left,
                                                          softcap, sink))


@fa4_bwd.register_fake
def _fa4_bwd_fake(dout, q, k, v, out, lse, scale, window_left=-1, softcap=0.0, sink=None):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(sink) if sink is not None else q.new_empty(0))


def _setup_context(ctx, inputs, output):
    q, k, v, scale, window_left, softcap, sink = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *([sink] if sink is not None else []))
    ctx.scale, ctx.window_left, ctx.softcap, ctx.has_sink = scale, window_left, softcap, sink is not None


def _backward(ctx, dout, _dlse):  # lse is an auxiliary output: nothing differentiates through it
    q, k, v, out, lse, *sink = ctx.saved_tensors
    sink = sink[0] if ctx.has_sink else None
    dq, dk, dv, dsink = torch.ops.ulysses.fa4_bwd(dout.contiguous(), q, k, v, out, lse, ctx.scale, ctx.window_left,
                                                  ctx.softcap, sink)
    return dq, dk, dv, None, None, None, dsink if ctx.has_sink else None


fa4_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("ulysses::fa4_varlen_fwd", mutates_args=())
def fa4_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float,
                   window_left: int = -1, softcap: float = 0.0,
                   sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return IMPL["varlen_forward"](q, k, v, cu_seqlens, max_seqlen, scale, window_left, softcap, sink)


@fa4_varlen_fwd.register_fake
def _fa4_varlen_fwd_fake(q, k, v, cu_seqlens, max_seqlen, scale, window_left=-1, softcap=0.0, sink=None):
    total, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((h, total), dtype=torch.float32)


@torch.library.custom_op("ulysses::fa4_varlen_bwd", mutates_args=())
def fa4_varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
                   max_seqlen: int, scale: float, window_left: int = -1, softcap: float = 0.0,
                   sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(t.contiguous() for t in IMPL["varlen_backward"](dout, q, k, v, out, lse, cu_seqlens, max_seqlen,
                                                                 scale, window_left, softcap, sink))


@fa4_varlen_bwd.register_fake
def _fa4_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, window_left=-1, softcap=0.0,
                         sink=None):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(sink) if sink is not None else q.new_empty(0))


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale, window_left, softcap, sink = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, *([sink] if sink is not None else []))
    ctx.max_seqlen, ctx.scale, ctx.window_left, ctx.softcap = max_seqlen, scale, window_left, softcap
    ctx.has_sink = sink is not None


def _varlen_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens, *sink = ctx.saved_tensors
    sink = sink[0] if ctx.has_sink else None
    dq, dk, dv, dsink = torch.ops.ulysses.fa4_varlen_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens,
                                                         ctx.max_seqlen, ctx.scale, ctx.window_left, ctx.softcap,
                                                         sink)
    return dq, dk, dv, None, None, None, None, None, dsink if ctx.has_sink else None


fa4_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)

FORWARD_OP = torch.ops.ulysses.fa4_fwd.default
VARLEN_FORWARD_OP = torch.ops.ulysses.fa4_varlen_fwd.default


def fa4_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, window_left: int = -1, softcap: float = 0.0,
                  sink: Optional[Tensor] = None) -> Tensor:
    """q (b, s, hq, d), k/v (b, s, hkv, d) -> (b, s, hq, d), causal (with a layer's pattern)."""
    return fa4_fwd(q, k, v, scale, window_left, softcap, sink)[0]


def fa4_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float,
                         window_left: int = -1, softcap: float = 0.0, sink: Optional[Tensor] = None) -> Tensor:
    """q (total, hq, d), k/v (total, hkv, d), documents at `cu_seqlens` -> (total, hq, d), causal in each."""
    return fa4_varlen_fwd(q, k, v, cu_seqlens, max_seqlen, scale, window_left, softcap, sink)[0]


# ---------------------------------------------------------------- exact reference (CPU tests)


def _expand(t: Tensor, heads: int) -> Tensor:
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def _mask(scores: Tensor, causal: bool, window_left: int = -1) -> Tensor:
    if not causal:
        return scores
    n, m = scores.shape[-2:]
    q_pos = torch.arange(n, device=scores.device)[:, None] + (m - n)  # bottom-right aligned, as the kernel
    k_pos = torch.arange(m, device=scores.device)[None, :]
    hidden = k_pos > q_pos
    if window_left >= 0:
        hidden |= k_pos < q_pos - window_left
    return scores.masked_fill(hidden, float("-inf"))


def _scores(qh, kh, scale, causal, window_left, softcap):
    """Masked (softcapped) scores in fp32 or wider, and tanh of the uncapped ones / softcap (None without)."""
    scores = (qh @ kh.transpose(-1, -2)) * scale
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    tanh = None
    if softcap:
        tanh = torch.tanh(scores / softcap)
        scores = softcap * tanh
    return _mask(scores, causal, window_left), tanh


def sink_gradient(sink: Tensor, lse: Tensor, delta: Tensor) -> Tensor:
    """The sinks' gradient: each row's sink probability (from its log-sum-exp with the sink, (b, h, s)) times minus
    its dout . out (`delta`, (b, h, s)), summed over the rows and the batch."""
    return -(torch.exp(sink.to(lse.dtype).view(1, -1, 1) - lse) * delta).sum(dim=(0, 2)).to(sink.dtype)


def reference_forward(q, k, v, scale, causal=True, window_left=-1, softcap=0.0, sink=None):
    """What the kernel computes, in plain ops: (out, lse) in the kernel's layouts (a sink joins every row's lse)."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, _expand(k, q.shape[2]), _expand(v, q.shape[2])))  # (b, h, s, d)
    scores, _ = _scores(qh, kh, scale, causal, window_left, softcap)
    lse = torch.logsumexp(scores, dim=-1)  # (b, h, s), fp32 as the kernel's (fp64 in fp64 tests)
    if sink is not None:
        lse = torch.logaddexp(lse, sink.to(lse.dtype).view(1, -1, 1))
    out = (torch.exp(scores - lse[..., None]).to(q.dtype) @ vh).transpose(1, 2).contiguous()
    return out, lse


def reference_backward(dout, q, k, v, out, lse, scale, causal=True, window_left=-1, softcap=0.0, sink=None):
    """The analytic gradient of softmax attention from (out, lse), with GQA heads summed per KV head; after dv, the
    sinks' gradient (empty without sinks). Analytic, not autograd: an op's implementation runs below autograd."""
    heads = q.shape[2]
    qh, kh, vh, oh, dh = (t.transpose(1, 2) for t in (q, _expand(k, heads), _expand(v, heads), out, dout))
    scores, tanh = _scores(qh, kh, scale, causal, window_left, softcap)
    p = torch.exp(scores - lse[..., None])  # (b, h, s, s)
    dv = p.to(dh.dtype).transpose(-1, -2) @ dh
    dp = dh @ vh.transpose(-1, -2)
    delta = (dh * oh).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    if tanh is not None:  # d(c tanh(x / c)) / dx
        ds = ds * (1 - tanh.square())
    ds = ds.to(qh.dtype)
    dq, dk = (ds @ kh) * scale, (ds.transpose(-1, -2) @ qh) * scale
    dsink = q.new_empty(0) if sink is None else sink_gradient(sink, lse, delta[..., 0])

    def per_kv(t, kv_heads):  # (b, h, s, d) -> (b, s, kv, d), summing each KV head's query heads
        b, h, n, d = t.shape
        return t.reshape(b, kv_heads, h // kv_heads, n, d).sum(2).transpose(1, 2).contiguous()

    return dq.transpose(1, 2).contiguous(), per_kv(dk, k.shape[2]), per_kv(dv, v.shape[2]), dsink


def reference_varlen_forward(q, k, v, cu_seqlens, max_seqlen, scale, window_left=-1, softcap=0.0, sink=None):
    """The varlen kernel in plain ops: each document through `reference_forward`; lse (h, total)."""
    outs, lses = [], []
    for a, b in zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist()):
        out, lse = reference_forward(q[None, a:b], k[None, a:b], v[None, a:b], scale, True, window_left, softcap,
                                     sink)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def reference_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, window_left=-1, softcap=0.0,
                              sink=None):
    grads = [reference_backward(dout[None, a:b], q[None, a:b], k[None, a:b], v[None, a:b], out[None, a:b],
                                lse[None, :, a:b], scale, True, window_left, softcap, sink)
             for a, b in zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())]
    dsink = sum(g[3] for g in grads) if sink is not None else q.new_empty(0)
    return (*(torch.cat([g[i][0] for g in grads]) for i in range(3)), dsink)


REFERENCE_IMPL = {"forward": reference_forward, "backward": reference_backward,
                  "varlen_forward": reference_varlen_forward, "varlen_backward": reference_varlen_backward}
