"""Cutting one batch of whole sequences into this rank's sequence shard.

Order matters: labels are shifted on the *whole* sequence first (so the label of a shard's last token is the first
token of the next shard), the sequence is padded at the end to a multiple of sp with ignored labels, and each shard
carries its global position ids so that RoPE sees global positions.
"""

from __future__ import annotations

from typing import Optional

import torch

IGNORE_INDEX = -100


def shift_labels(input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(b, s) -> (b, s): position t is trained to predict token t+1 of the whole sequence; the last is ignored."""
    source = input_ids if labels is None else labels
    shifted = torch.full_like(source, IGNORE_INDEX)
    shifted[:, :-1] = source[:, 1:]
    return shifted


def shard_sequence(input_ids: torch.Tensor, sp_size: int, sp_rank: int, labels: Optional[torch.Tensor] = None,
                   position_ids: Optional[torch.Tensor] = None, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Returns this rank's `input_ids`, `labels` (already shifted) and `position_ids`, each (b, s_pad/sp).

    `labels` defaults to `input_ids` (causal LM); pass `position_ids` for packed documents (restarting at each one).
    """
    b, s = input_ids.shape
    shifted = shift_labels(input_ids, labels)
    if position_ids is None:
        position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
    pad = (-s) % sp_size
    if pad:
        input_ids = torch.cat([input_ids, input_ids.new_full((b, pad), pad_token_id)], dim=1)
        shifted = torch.cat([shifted, shifted.new_full((b, pad), IGNORE_INDEX)], dim=1)
        # padded tokens sit after every real token, so under causal attention no real token sees them
        tail = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)
        position_ids = torch.cat([position_ids, tail], dim=1)
    local = (s + pad) // sp_size
    cut = slice(sp_rank * local, (sp_rank + 1) * local)
    return {"input_ids": input_ids[:, cut].contiguous(), "labels": shifted[:, cut].contiguous(),
            "position_ids": position_ids[:, cut].contiguous()}
