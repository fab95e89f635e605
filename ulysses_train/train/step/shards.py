"""From a batch of whole sequences to this rank's shard (training and evaluation alike)."""

from __future__ import annotations

from ...sp.sharding import shard_sequence


def shard_batch(run, batch: dict) -> dict:
    """This rank's shard of a batch of whole sequences, on its device; the attention learns the documents."""
    g = run.groups
    pad_id = getattr(run.tokenizer, "pad_token_id", None) or 0
    shard = {k: v.to(run.device) for k, v in shard_sequence(  # (b, s) -> (b, s/sp) each
        batch["input_ids"], g.sp_size, g.sp_rank, labels=batch["labels"], position_ids=batch["position_ids"],
        pad_token_id=pad_id, ring_size=g.ring_size).items()}
    padded = shard["input_ids"].shape[1] * g.sp_size - batch["input_ids"].shape[1]
    docs = batch["docs"]  # the padding added for sp is one more (ignored) document
    run.attention.doc_lengths = [row + [padded] for row in docs] if docs is not None and padded else docs
    return shard
