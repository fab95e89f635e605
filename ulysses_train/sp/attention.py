"""Ulysses attention for any Hugging Face decoder, through transformers' attention interface.

`register_ulysses_attention(sp_group, kernel)` registers the name "ulysses" with `AttentionInterface` (and a mask
function that builds no mask, since the kernel applies causality itself over the *gathered* sequence, which a mask
built from the local shard could not describe). A model loaded with `attn_implementation="ulysses"`, or switched
with `model.set_attn_implementation("ulysses")`, then runs:

    q (b, h, s/sp, d), k/v (b, kv, s/sp, d)
      -> [replicate KV heads if kv < sp] -> all-to-all -> q (b, h/sp, s, d), k/v (b, kv/sp or 1, s, d)
      -> local kernel over the whole sequence for this rank's heads -> (b, s, h/sp, d)
      -> all-to-all -> (b, s/sp, h, d)

With a ring (`ring_group` of more than one rank, ring.py), the all-to-all runs over the Ulysses group only and
gathers this ring rank's pair of zigzag chunks instead of the whole sequence; the ring then attends them to every
other ring rank's K/V:

    q (b, h, s/sp, d) -> all-to-all over Ulysses (u ranks) -> (b, h/u, s/ring, d) -> ring -> (b, s/ring, h/u, d)
      -> all-to-all -> (b, s/sp, h, d)

Head blocks are contiguous, so rank r holds query heads [r*h/sp, (r+1)*h/sp) and exactly the KV heads those
query heads use: with g = h/kv query heads per KV head, query head i reads KV head i // g, and the block of rank r
reads KV heads [r*kv/sp, (r+1)*kv/sp) when sp divides kv, or KV head r*kv/sp (one, after replicating each KV head
sp/kv times) when kv divides sp.
"""

from __future__ import annotations

from typing import Optional

import torch

from .all_to_all import all_to_all, group_size
from .kernels import KERNELS
from .ring import RingAttention
from .weak_group import WeakGroup

ATTN_NAME = "ulysses"


class UlyssesAttention:
    """The attention function transformers calls, as `fn(module, query, key, value, attention_mask, **kw)`.

    `sp_group` is the process group of the ranks whose all-to-all splits the heads: the whole SP group, or with a
    ring its Ulysses group (None or size 1: no all-to-all). `ring_group`: the ring across Ulysses groups."""

    def __init__(self, sp_group, kernel: str = "sdpa", ring_group=None):
        self._sp_group = WeakGroup(sp_group)  # registered globally with transformers: must not keep the group alive
        self.sp = group_size(sp_group)
        self.kernel_name = kernel
        self.kernel = KERNELS[kernel]
        self.ring = RingAttention(ring_group, kernel) if group_size(ring_group) > 1 else None
        self._doc_lengths, self._doc_ids = None, None

    @property
    def sp_group(self):
        return self._sp_group.get()

    @property
    def doc_lengths(self) -> Optional[list[list[int]]]:
        """Packed documents of the current batch, global (whole-sequence) lengths per row; None: one causal sequence.
        Set by the caller before the forward and kept until the next batch (checkpoint recompute reads it again)."""
        return self._doc_lengths

    @doc_lengths.setter
    def doc_lengths(self, lengths: Optional[list[list[int]]]) -> None:
        self._doc_lengths = lengths
        # the ring's form of it: the document of every position, (b, s) on the CPU (it only plans kernel calls)
        self._doc_ids = None if lengths is None or self.ring is None else torch.stack([
            torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row, dtype=torch.long)) for row in lengths])

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
        # (b, h, s/sp, d) -> (b, h/sp, s, d)   (with a ring: s/ring, this ring rank's pair of chunks)
        q, k, v = (all_to_all(t, self.sp_group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
        if self.ring is not None:
            if self._doc_ids is not None and self._doc_ids.shape[1] != q.shape[2] * self.ring.size:
                raise ValueError(f"doc_lengths cover {self._doc_ids.shape[1]} positions, the sequence has "
                                 f"{q.shape[2] * self.ring.size}")
            out = self.ring(q, k, v, scale, self._doc_ids)  # (b, s/ring, h/sp, d)
        else:
            out = self.kernel(q, k, v, scale, self.doc_lengths)  # (b, s, h/sp, d)
        # (b, s, h/sp, d) -> (b, s/sp, h, d)
        return all_to_all(out, self.sp_group, scatter_dim=1, gather_dim=2), None


def _no_mask(*args, **kwargs):
    """Mask function for the "ulysses" name: no mask tensor; causality is applied by the kernel."""
    return None


def register_ulysses_attention(sp_group, kernel: str = "sdpa", ring_group=None) -> UlyssesAttention:
    """Registers "ulysses" with transformers' attention and mask interfaces; returns the live wrapper. With a ring,
    `sp_group` is the Ulysses group (SequenceParallelGroups.ulysses_group)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    attn = UlyssesAttention(sp_group, kernel, ring_group)
    AttentionInterface.register(ATTN_NAME, attn)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)
    return attn
