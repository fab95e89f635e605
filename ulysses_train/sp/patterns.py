"""What a layer's attention does beyond full causal attention, and the exact SDPA path for it.

A `Pattern` is one layer's sliding window, attention sinks and logit softcap, as the kernels take it (chunked
attention never reaches a kernel: `chunk_documents` turns its chunks into documents, which every kernel already
keeps apart). Conventions are transformers': a window of `w` lets a query see the `w` keys ending at itself
(its SDPA mask keeps `kv > q - w`, its FlashAttention path passes `(w - 1, 0)`); a sink `s_h` adds `exp(s_h)` to
every row's softmax denominator of head `h` (GPT-OSS's eager attention); a softcap `c` maps each score `x` to
`c * tanh(x / c)` before the mask (Gemma 2).

`patterned_sdpa` is the SDPA kernel for these, exact and never s x s in memory:
- a window runs in query blocks of `block` rows against only the keys their window reaches, with one band mask
  shared by every block away from a document's start: O(s x (block + w)) per layer;
- sinks on a full causal layer merge into the log-sum-exp of a kernel without them (`_SinkMerge`): the sink is a
  key of value zero, so it only adds `exp(s_h)` to each row's denominator, and the block kernel (cuDNN on CUDA,
  ATen's flash attention on the CPU; block_kernels.py) runs with the KV heads as they are;
- sinks on a windowed block join as one extra key that every query sees: q gets a column of ones and k a zero
  column, the sink key is `s_h / scale` in that column (so its score is exactly `s_h`) with a zero value. The
  column is padded with zeros to a multiple of 8 head dims: CUDA's fused SDPA kernels take nothing else, and an
  unpadded 64 + 1 (GPT-OSS) would send them to the math fallback, which holds every block's scores in fp32;
- a softcap, which SDPA cannot express, runs the scores explicitly per query block, each block recomputed in the
  backward (checkpointed), so only one block's scores are ever alive. Exact, and slow: on CUDA the support check
  sends softcapped models to FA2 or FA4 instead (support.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from . import block_kernels, fa4_op


@dataclass(frozen=True)
class Pattern:
    """One layer's attention beyond full causal: for this rank's heads, after the all-to-all."""

    window: Optional[int] = None  # keys a query sees, itself included
    softcap: Optional[float] = None
    sinks: Optional[Tensor] = None  # (heads on this rank,): the sink logit of each

    @property
    def window_left(self) -> int:
        """The window as FlashAttention takes it: keys before the query (-1: no window)."""
        return -1 if self.window is None else self.window - 1

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and self.sinks is None


FULL = Pattern()


def chunk_documents(docs: Optional[list[list[int]]], batch: int, seq_len: int, chunk: int) -> list[list[int]]:
    """Each document cut into pieces of `chunk` positions from its start (as transformers cuts a packed row's
    documents): chunked attention is causal attention inside each piece."""
    rows = docs if docs is not None else [[seq_len]] * batch
    return [[min(chunk, n - a) for n in lengths for a in range(0, n, chunk)] for lengths in rows]


def _band_mask(q_pos: Tensor, k_pos: Tensor, window: Optional[int]) -> Tensor:
    """(nq, nk) bool: key visible to query (causal, and inside the window)."""
    keep = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        keep &= k_pos[None, :] > q_pos[:, None] - window
    return keep


SINK_COLUMNS = 8  # the sink's column and its zero padding: fused SDPA kernels take head dims that are multiples of 8


def _with_sink(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """q (b, h, n, d), k/v (b, kv, m, d) -> the sink's columns and one sink key in front: q (b, h, n, d+8),
    k and v (b, h, m+1, d+8). The KV heads are copied to every query head: each head has its own sink. v gets
    the zero columns too (its outputs there are zero): every fused kernel takes equal head dims, not all take
    unequal ones."""
    b, h, _, d = q.shape
    k, v = (F.pad(t.repeat_interleave(h // t.shape[1], dim=1), (0, SINK_COLUMNS)) for t in (k, v))
    ones = F.pad(q.new_ones(*q.shape[:-1], 1), (0, SINK_COLUMNS - 1))
    q = torch.cat([q, ones], dim=-1)
    sink_key = F.pad((sinks.to(k.dtype) / scale).view(1, h, 1, 1).expand(b, h, 1, 1), (d, SINK_COLUMNS - 1))
    return q, torch.cat([sink_key, k], dim=2), F.pad(v, (0, 0, 1, 0))


def _explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, softcap: Optional[float],
              sinks: Optional[Tensor]) -> Tensor:
    """Scores in plain ops (softmax in fp32 at least): q (b, h, n, d), k/v (b, kv, m, d), mask (n, m)
    -> (b, h, n, d)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :k.shape[2]]
    return probs.to(v.dtype) @ v


def _block(q, k, v, mask, scale, pattern: Pattern) -> Tensor:
    """One query block against its keys, (b, h, n, d)."""
    if pattern.softcap is not None:  # SDPA has no softcap: explicit scores, recomputed in the backward
        return checkpoint(_explicit, q, k, v, mask, scale, pattern.softcap, pattern.sinks, use_reentrant=False)
    if pattern.sinks is not None:
        d = v.shape[-1]
        q, k, v = _with_sink(q, k, v, pattern.sinks, scale)
        mask = torch.cat([mask.new_ones(mask.shape[0], 1), mask], dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[..., :d]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


class _SinkMerge(torch.autograd.Function):
    """Full causal attention with one sink logit per head, from a block kernel without sinks.

    The kernel's (out, lse) become lse' = logaddexp(lse, s_h) and out' = out * exp(lse - lse') (ring.merge with a
    block of value zero, without building it). Handed (out', lse'), the kernel's flash-style backward gives the
    exact dq, dk and dv of the softmax with the sink (its value is zero, so it adds nothing to the rows'
    dout . out'), and the sink's own gradient is -sum over rows of P_sink * (dout . out'). Nothing s x s is held,
    and GQA's KV heads are not copied."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, scale: float, kernel) -> Tensor:
        # q (b, s, h, d), k/v (b, s, kv, d), sinks (h,) -> (b, s, h, d)
        out, lse = kernel.forward(q, k, v, scale, True)  # lse (b, h, s), fp32 or wider
        merged = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
        out = (out * torch.exp(lse - merged).transpose(1, 2).unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, merged, sinks)
        ctx.scale, ctx.kernel = scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, merged, sinks = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout.contiguous(), q, k, v, out, merged, ctx.scale, True)
        return dq, dk, dv, fa4_op.sink_gradient(sinks, merged, _row_dots(dout, out, merged.dtype)), None, None


ROW_DOT_CHUNK_BYTES = 256 << 20  # the widened product of one chunk of rows: a full layer's is 2 GiB at 131k in fp32


def _row_dots(dout: Tensor, out: Tensor, dtype: torch.dtype) -> Tensor:
    """dout . out per row and head in `dtype`, (b, s, h, d) -> (b, h, s), a chunk of positions at a time: the widened
    product of a whole layer (4 bytes x tokens x heads x head dim) is not held at once."""
    b, s, h, d = out.shape
    rows = max(1, ROW_DOT_CHUNK_BYTES // (b * h * d * dtype.itemsize))
    dots = torch.empty(b, s, h, dtype=dtype, device=out.device)
    for a in range(0, s, rows):
        dots[:, a:a + rows] = (dout[:, a:a + rows].to(dtype) * out[:, a:a + rows]).sum(-1)
    return dots.transpose(1, 2)


def _causal_with_sinks(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, scale: float) -> Tensor:
    """q (b, h, n, d), k/v (b, kv, n, d): full causal attention with sinks -> (b, h, n, d)."""
    kernel = block_kernels.block_kernel("sdpa", q.device, q.dtype)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, n, h, d), the block kernels' layout
    return _SinkMerge.apply(q, k, v, sinks, scale, kernel).transpose(1, 2)


def _segment(q: Tensor, k: Tensor, v: Tensor, scale: float, pattern: Pattern, block: int) -> Tensor:
    """One document: q (b, h, n, d), k/v (b, kv, n, d) -> (b, h, n, d)."""
    n = q.shape[2]
    if pattern.window is None and pattern.softcap is None:
        return _causal_with_sinks(q, k, v, pattern.sinks, scale)
    reach = pattern.window if pattern.window is not None else n  # how far back a query's keys go
    positions = torch.arange(n, device=q.device)
    masks: dict[tuple[int, int, int], Tensor] = {}  # one band mask for every block of the same shape
    outs = []
    for a in range(0, n, block):
        b = min(n, a + block)
        lo = max(0, a - reach + 1)
        key = (b - a, b - lo, a - lo)
        if key not in masks:
            masks[key] = _band_mask(positions[a:b], positions[lo:b], pattern.window)
        outs.append(_block(q[:, :, a:b], k[:, :, lo:b], v[:, :, lo:b], masks[key], scale, pattern))
    return torch.cat(outs, dim=2)


def patterned_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, docs: Optional[list[list[int]]],
                   pattern: Pattern, block: int = 1024) -> Tensor:
    """q (b, h, s, d), k/v (b, kv, s, d), causal inside each document with `pattern` -> (b, s, h, d)."""
    rows = docs if docs is not None else [[q.shape[2]]] * q.shape[0]
    block = max(block, pattern.window or 0)
    out_rows = []
    for r, lengths in enumerate(rows):
        pieces, start = [], 0
        for n in lengths:
            cut = slice(start, start + n)
            pieces.append(_segment(q[r:r + 1, :, cut], k[r:r + 1, :, cut], v[r:r + 1, :, cut], scale, pattern,
                                   block))
            start += n
        out_rows.append(torch.cat(pieces, dim=2))
    return torch.cat(out_rows, dim=0).transpose(1, 2)
