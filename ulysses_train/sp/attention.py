"""Ulysses attention for any Hugging Face decoder, through transformers' attention interface.

`register_ulysses_attention(sp_group, kernel)` registers the name "ulysses" with `AttentionInterface` (and a mask
function that builds no mask, since the kernel applies causality itself over the *gathered* sequence, which a mask
built from the local shard could not describe). A model loaded with `attn_implementation="ulysses"`, or switched
with `model.set_attn_implementation("ulysses")`, then runs:

    q (b, h, s/sp, d), k/v (b, kv, s/sp, d)
      -> [replicate KV heads if kv < sp] -> all-to-all -> q (b, h/sp, s, d), k/v (b, kv/sp or 1, s, d)
      -> local kernel over the whole sequence for this rank's heads -> (b, s, h/sp, d)
      -> all-to-all -> (b, s/sp, h, d)

Head blocks are contiguous, so rank r holds query heads [r*h/sp, (r+1)*h/sp) and exactly the KV heads those
query heads use: with g = h/kv query heads per KV head, query head i reads KV head i // g, and the block of rank r
reads KV heads [r*kv/sp, (r+1)*kv/sp) when sp divides kv, or KV head r*kv/sp (one, after replicating each KV head
sp/kv times) when kv divides sp.
"""

from __future__ import annotations

from typing import Optional

from .all_to_all import all_to_all, group_size
from .kernels import KERNELS

ATTN_NAME = "ulysses"


class UlyssesAttention:
    """The attention function transformers calls, as `fn(module, query, key, value, attention_mask, **kw)`.

    `sp_group` is the process group of the ranks sharing one sequence (None or size 1: plain local attention)."""

    def __init__(self, sp_group, kernel: str = "sdpa"):
        self.sp_group = sp_group
        self.sp = group_size(sp_group)
        self.kernel_name = kernel
        self.kernel = KERNELS[kernel]
        # packed documents of the current batch, global (whole-sequence) lengths per row; None: one causal sequence.
        # Set by the caller before the forward and kept until the next batch (checkpoint recompute reads it again).
        self.doc_lengths: Optional[list[list[int]]] = None

    def __call__(self, module, query, key, value, attention_mask, dropout: float = 0.0,
                 scaling: Optional[float] = None, sliding_window: Optional[int] = None, **kwargs):
        if sliding_window is not None:
            raise NotImplementedError("Ulysses attention supports full-attention layers only (sliding_window is set)")
        if dropout:
            raise NotImplementedError("attention dropout is not supported: set the model's attention_dropout to 0")
        if attention_mask is not None:
            raise NotImplementedError("padding masks are not supported: pad at the end with labels -100 instead")
        sp, kv_heads = self.sp, key.shape[1]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if kv_heads % sp != 0:
            # kv divides sp (checked at start-up): give each KV head to sp/kv consecutive ranks
            key, value = (t.repeat_interleave(sp // kv_heads, dim=1) for t in (key, value))
        # (b, h, s/sp, d) -> (b, h/sp, s, d)
        q, k, v = (all_to_all(t, self.sp_group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
        out = self.kernel(q, k, v, scale, self.doc_lengths)  # (b, s, h/sp, d)
        # (b, s, h/sp, d) -> (b, s/sp, h, d)
        return all_to_all(out, self.sp_group, scatter_dim=1, gather_dim=2), None


def _no_mask(*args, **kwargs):
    """Mask function for the "ulysses" name: no mask tensor; causality is applied by the kernel."""
    return None


def register_ulysses_attention(sp_group, kernel: str = "sdpa") -> UlyssesAttention:
    """Registers "ulysses" with transformers' attention and mask interfaces; returns the live wrapper."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    attn = UlyssesAttention(sp_group, kernel)
    AttentionInterface.register(ATTN_NAME, attn)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)
    return attn
