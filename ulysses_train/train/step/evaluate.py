"""Validation loss (`--eval_dataset`): at the training length, under SP, forward only.

Each DP group evaluates every dp-th micro-batch of the first `--eval_samples` samples (all by default), each at
full length through the same sharded path as training (no switching SP off, so what is measured is what trains).
The loss is the mean over every trainable token of those samples, the same normalisation as the training loss.
Micro-batches past the last sample are run with no target, so every rank takes part in every collective.
Preference pairs (--method dpo|simpo|orpo) are evaluated the same way with their own loss and TRL's metrics
(eval_rewards/margins, ...: train/preference/pairs.py), DPO's against the reference log-probs of the eval pairs; the
run's `step_kind` says which (train/step/step_kind.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ...data.sources import build_batch, trainable_tokens
from ...sp.sharding import IGNORE_INDEX
from .shards import shard_batch


def evaluate_tokens(run, source, max_samples: Optional[int]) -> dict:
    g, micro = run.groups, run.micro
    n = source.num_samples if max_samples is None else min(source.num_samples, max_samples)
    totals = torch.zeros(2, dtype=torch.float64, device=run.device)  # (cross-entropy summed, trainable tokens)
    run.engine.eval()
    try:
        with torch.no_grad():
            for first in range(0, n, micro * g.dp_size):
                indices = [first + g.dp_rank * micro + r for r in range(micro)]
                batch = build_batch([source.get(min(i, n - 1)) for i in indices], run.cfg.data.packing)
                for row, index in enumerate(indices):
                    if index >= n:  # past the end: the same shapes, nothing counted
                        batch["labels"][row] = IGNORE_INDEX
                shard = shard_batch(run, batch)
                ce_sum = run.engine(shard["input_ids"], shard["position_ids"], shard["labels"],
                                    torch.ones((), device=run.device))
                totals[0] += ce_sum.double()
                if g.sp_rank == 0:  # every rank of an SP group holds the whole batch: count it once
                    totals[1] += trainable_tokens(batch)
    finally:
        run.engine.train()
    dist.all_reduce(totals)
    tokens = int(totals[1].item())
    # no target (the first --eval_samples train nothing): no loss, not a loss of 0
    return {"eval_loss": totals[0].item() / tokens if tokens else None, "eval_tokens": tokens, "eval_samples": n,
            "eval_micro_batches": math.ceil(n / (micro * g.dp_size))}
