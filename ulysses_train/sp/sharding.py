"""Cutting one batch of whole sequences into this rank's sequence shard.

Order matters: labels are shifted on the *whole* sequence first (so the label of a shard's last token is the first
token of the next shard), the sequence is padded at the end to a multiple of sp with ignored labels, and each shard
carries its global position ids so that RoPE sees global positions.

With a ring (`ring_size` > 1) a rank's shard is not one contiguous piece: the sequence is cut into 2 x ring chunks,
ring rank i holds chunks i and 2 ring - 1 - i (zigzag, so that causal work is even; ring.py), and the Ulysses ranks
of ring rank i split that pair in order. `shard_order` lists the global positions in the order the SP ranks hold
them; every per-token tensor (ids, labels, positions) is cut with it, so they stay consistent.
"""

from __future__ import annotations

from typing import Optional

import torch

from .dims import sequence_multiple

IGNORE_INDEX = -100


def block_positions(owner: int, ring_size: int, chunk: int) -> torch.Tensor:
    """The global positions ring rank `owner` holds: chunks owner and 2R-1-owner, in that order, (2 chunk,)."""
    second = 2 * ring_size - 1 - owner
    return torch.cat([torch.arange(owner * chunk, (owner + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


def shard_order(seq_len: int, ring_size: int = 1) -> torch.Tensor:
    """(seq_len,): the global positions of the SP ranks' shards laid end to end (rank 0's first), whatever the
    Ulysses degree: SP rank r holds entries [r * seq_len/sp, (r+1) * seq_len/sp). Without a ring: 0, 1, 2, ...;
    `order.argsort()` undoes it (gathered shards back into sequence order)."""
    if ring_size == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * ring_size)
    return torch.cat([block_positions(i, ring_size, chunk) for i in range(ring_size)])


def shift_labels(input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(b, s) -> (b, s): position t is trained to predict token t+1 of the whole sequence; the last is ignored."""
    source = input_ids if labels is None else labels
    shifted = torch.full_like(source, IGNORE_INDEX)
    shifted[:, :-1] = source[:, 1:]
    return shifted


def shard_sequence(input_ids: torch.Tensor, sp_size: int, sp_rank: int, labels: Optional[torch.Tensor] = None,
                   position_ids: Optional[torch.Tensor] = None, pad_token_id: int = 0,
                   ring_size: int = 1) -> dict[str, torch.Tensor]:
    """Returns this rank's `input_ids`, `labels` (already shifted) and `position_ids`, each (b, s_pad/sp).

    `labels` defaults to `input_ids` (causal LM); pass `position_ids` for packed documents (restarting at each one).
    The sequence is padded to a multiple of sp (with a ring: of lcm(2 ring, sp), dims.sequence_multiple).
    """
    b, s = input_ids.shape
    shifted = shift_labels(input_ids, labels)
    if position_ids is None:
        position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
    pad = (-s) % sequence_multiple(sp_size, ring_size)
    if pad:
        input_ids = torch.cat([input_ids, input_ids.new_full((b, pad), pad_token_id)], dim=1)
        shifted = torch.cat([shifted, shifted.new_full((b, pad), IGNORE_INDEX)], dim=1)
        # padded tokens sit after every real token, so under causal attention no real token sees them
        tail = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)
        position_ids = torch.cat([position_ids, tail], dim=1)
    local = (s + pad) // sp_size
    if ring_size == 1:
        cut = slice(sp_rank * local, (sp_rank + 1) * local)
    else:  # this rank's positions, in the order the ring's attention expects them
        cut = shard_order(s + pad, ring_size)[sp_rank * local:(sp_rank + 1) * local].to(input_ids.device)
    return {"input_ids": input_ids[:, cut].contiguous(), "labels": shifted[:, cut].contiguous(),
            "position_ids": position_ids[:, cut].contiguous()}
