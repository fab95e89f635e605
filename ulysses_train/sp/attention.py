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

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .all_to_all import all_to_all, group_size
from .kernels import KERNELS
from .patterns import Pattern, chunk_documents
from .ring import RingAttention
from .support import LayerMixer, layer_mixers
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
        self._tables: dict[int, tuple] = {}  # id(model config) -> (a weak reference to it, its layers: support.py)

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
                 scaling: Optional[float] = None, sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                 s_aux: Optional[torch.Tensor] = None, **kwargs):
        mixer = self._layer(module, sliding_window, softcap, s_aux, kwargs)
        if dropout:
            raise NotImplementedError("attention dropout is not supported: set the model's attention_dropout to 0")
        if attention_mask is not None:
            raise NotImplementedError("padding masks are not supported: pad at the end with labels -100 instead")
        sp, kv_heads = self.sp, key.shape[1]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if mixer.temperature_tuning and sp > 1:
            query = self._global_temperature(module, query)
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
            docs = self.doc_lengths
            if mixer.chunk:  # block-diagonal: the chunks are documents of their own
                docs = chunk_documents(docs, q.shape[0], q.shape[2], mixer.chunk)
            pattern = Pattern(mixer.window, mixer.softcap, None if s_aux is None else self._my_heads(s_aux))
            out = self.kernel(q, k, v, scale, docs, pattern)  # (b, s, h/sp, d)
        # (b, s, h/sp, d) -> (b, s/sp, h, d)
        return all_to_all(out, self.sp_group, scatter_dim=1, gather_dim=2), None

    def _layer(self, module, sliding_window, softcap, s_aux, kwargs) -> LayerMixer:
        """The layer's mixer from the model's config (support.py), checked against what the layer passed:
        an argument the table does not account for is an error, never ignored."""
        unknown = sorted(set(kwargs) - PASSED_THROUGH)
        if unknown:
            raise TypeError(f"{type(module).__name__} passes {', '.join(unknown)} to the attention, which the Ulysses "
                            f"attention does not implement")
        if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
            raise NotImplementedError(f"{type(module).__name__} is not causal: the kernels are causal only")
        config = getattr(module, "config", None)
        if config is None or getattr(module, "layer_idx", None) is None:  # called directly: what it passes is all
            return LayerMixer("attention", window=sliding_window, softcap=softcap, sinks=s_aux is not None)
        ref, table = self._tables.get(id(config), (None, None))
        if ref is None or ref() is not config:  # a config freed since may have left its id to this one
            table = layer_mixers(config)
            self._tables[id(config)] = (weakref.ref(config), table)
        mixer = table[module.layer_idx]
        passed = {"sliding_window": (sliding_window, mixer.window), "softcap": (softcap, mixer.softcap),
                  "s_aux": (s_aux is not None, mixer.sinks)}
        for name, (got, want) in passed.items():
            if (got or None) != (want or None) and not (name == "sliding_window" and got is None):
                raise ValueError(f"layer {module.layer_idx} of {config.model_type} passes {name}={got!r} to the "
                                 f"attention, where its config says {want!r} (support.py)")
        return mixer

    def _rank(self) -> int:
        return dist.get_rank(self.sp_group) if self.sp > 1 else 0

    def _my_heads(self, per_head: torch.Tensor) -> torch.Tensor:
        """This rank's block of a per-query-head tensor (the sinks), as the all-to-all splits the heads."""
        local, rank = per_head.shape[0] // self.sp, self._rank()
        return per_head[rank * local:(rank + 1) * local]

    def _global_temperature(self, module, query: torch.Tensor) -> torch.Tensor:
        """Llama 4 scales a NoPE layer's q by a function of the row position, which it reads as the local index
        (`arange` over this shard): rescale it to the global row position. q (b, h, s/sp, d)."""
        local = torch.arange(query.shape[2], device=query.device, dtype=torch.float32)
        offset = self._rank() * query.shape[2]

        def temperature(p):
            return torch.log1p(torch.floor((p + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

        ratio = temperature(local + offset) / temperature(local)
        return (query.float() * ratio.view(1, 1, -1, 1)).to(query.dtype)


# what transformers' layers pass besides the attention's own arguments, none of which changes what it computes
PASSED_THROUGH = {"position_ids", "use_cache", "output_router_logits", "output_attentions", "cache_position",
                  "is_causal"}


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
