"""Attention kernels for one block of the ring: the forward with its log-sum-exp, and the backward from a given
(out, lse).

The ring (ring.py) runs the local kernel on blocks of the sequence and merges the partial outputs through their
log-sum-exps; its backward hands each block the *merged* output and log-sum-exp, from which a flash-style backward
gives that block's exact share of dq, dk and dv. So a kernel qualifies when its forward returns the log-sum-exp and
its backward accepts an (out, lse) it did not produce:

    sdpa          CPU: ATen's flash attention for CPU; CUDA, bf16/fp16: cuDNN attention (ATen's op); CUDA fp32:
                  the plain-ops reference below (exact; holds the block's score matrix)
    flash_attn    FA2's `_flash_attn_forward` / `_flash_attn_backward` (arguments matched by name: they moved
                  between releases)
    flash_attn_4  FA4 through fa4_op.IMPL (the CPU tests swap in its exact reference)

Layout (b, s, h, d) for q, k, v, out and the gradients (FlashAttention's; SDPA's ops get (b, h, s, d) views), lse
(b, h, s) in fp32 (fp64 for fp64 inputs). GQA native: k and v may have fewer heads, dk and dv come back with them.
`causal` is only asked for square blocks whose rows are the same positions.
"""

from __future__ import annotations

import inspect
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from . import fa4_op


class BlockKernel(NamedTuple):
    forward: Callable  # (q, k, v, scale, causal) -> (out, lse)
    backward: Callable  # (dout, q, k, v, out, lse, scale, causal) -> (dq, dk, dv)


def _heads_first(*tensors: Tensor) -> list[Tensor]:
    return [t.transpose(1, 2) for t in tensors]  # (b, s, h, d) <-> (b, h, s, d), views


# ---------------------------------------------------------------- SDPA on the CPU: ATen's flash attention


def _cpu_forward(q, k, v, scale, causal):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*_heads_first(q, k, v), 0.0, causal,
                                                                         scale=scale)
    return out.transpose(1, 2), lse


def _cpu_backward(dout, q, k, v, out, lse, scale, causal):
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_heads_first(dout, q, k, v, out), lse, 0.0, causal, scale=scale)
    return _heads_first(*grads)


# ---------------------------------------------------------------- SDPA on CUDA: cuDNN

# The cuDNN backward takes the forward's random-number state and sequence offsets even without dropout or nested
# tensors; the placeholders of the latest forward on each device are handed back (what SDPA's own autograd does).
# Its log-sum-exp goes back with the dims the op returns it in (fa4_op.as_cudnn_stats: a trailing 1 in some releases).
_CUDNN_EXTRAS: dict = {}


def _cudnn_forward(q, k, v, scale, causal):
    out, lse, cum_q, cum_k, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *_heads_first(q, k, v), None, True, 0.0, causal, False, scale=scale)
    _CUDNN_EXTRAS[q.device] = (seed, offset, cum_q, cum_k)
    b, h, n = out.shape[:3]
    return out.transpose(1, 2), lse.reshape(b, h, n)


def _cudnn_backward(dout, q, k, v, out, lse, scale, causal):
    seed, offset, cum_q, cum_k = _CUDNN_EXTRAS[q.device]
    stats = fa4_op.as_cudnn_stats(lse.contiguous())  # as the forward returned it
    qh, kh, vh, oh, dh = _heads_first(q, k, v, out, dout)
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dh, qh, kh, vh, oh, stats, seed, offset, None, cum_q, cum_k, q.shape[1], k.shape[1], 0.0, causal, scale=scale)
    return _heads_first(*grads)


# ---------------------------------------------------------------- FA2 (package flash-attn)


def _call_by_name(fn, **values):
    """`fn` with the arguments it takes among `values` (FA2's private functions changed signature between
    releases: window_size vs window_size_left/right, softcap, rng_state)."""
    params = inspect.signature(fn).parameters
    return fn(**{name: value for name, value in values.items() if name in params})


def _fa2_forward(q, k, v, scale, causal):
    from flash_attn.flash_attn_interface import _flash_attn_forward

    result = _call_by_name(_flash_attn_forward, q=q, k=k, v=v, dropout_p=0.0, softmax_scale=scale, causal=causal,
                           window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
                           alibi_slopes=None, return_softmax=False)
    # 2.6+: (out, lse, S_dmask, rng_state); earlier: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
    return (result[0], result[1]) if len(result) == 4 else (result[0], result[5])


def _fa2_backward(dout, q, k, v, out, lse, scale, causal):
    from flash_attn.flash_attn_interface import _flash_attn_backward

    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    _call_by_name(_flash_attn_backward, dout=dout.contiguous(), q=q, k=k, v=v, out=out, softmax_lse=lse.contiguous(),
                  dq=dq,
                  dk=dk, dv=dv, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(-1, -1),
                  window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
                  rng_state=None)
    return dq, dk, dv


# ---------------------------------------------------------------- FA4, and the plain-ops reference


def _fa4_forward(q, k, v, scale, causal):
    return fa4_op.IMPL["forward"](q, k, v, scale, causal)


def _fa4_backward(dout, q, k, v, out, lse, scale, causal):
    return fa4_op.IMPL["backward"](dout.contiguous(), q, k, v, out, lse.contiguous(), scale, causal)[:3]


def _reference_backward(dout, q, k, v, out, lse, scale, causal):
    return fa4_op.reference_backward(dout, q, k, v, out, lse, scale, causal)[:3]


REFERENCE = BlockKernel(fa4_op.reference_forward, _reference_backward)


def block_kernel(name: str, device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """The block kernel of `--attn_kernel name` (already resolved by kernels.resolve_kernel) on this device."""
    if name == "flash_attn_4":
        return BlockKernel(_fa4_forward, _fa4_backward)
    if name == "flash_attn":
        return BlockKernel(_fa2_forward, _fa2_backward)
    if name != "sdpa":
        raise ValueError(f"no ring block kernel for {name}")
    if device.type == "cpu":
        return BlockKernel(_cpu_forward, _cpu_backward)
    if dtype in (torch.bfloat16, torch.float16):
        return BlockKernel(_cudnn_forward, _cudnn_backward)
    return REFERENCE  # fp32 on CUDA: no fused kernel both returns the lse and takes fp32
