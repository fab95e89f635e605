"""Preference training in the loop (--method dpo|simpo|orpo): a step's counts, each micro-batch's
objective, and the metrics TRL logs (the flags themselves: flag_checks.py).

A step is the SFT step (loop.py) with another objective: every rank of an SP group holds the micro-batch's whole
rows of pairs (data/pair_packing.py), shards them with their `segments`, and the LM head returns the preference loss
(levers/preference_loss.py) normalised by the pairs of the whole optimizer step (every micro-batch, every DP rank;
ORPO's NLL by the step's chosen completion tokens). DeepSpeed's averaging is undone as for SFT. The metrics are
TRL's: the means over the step's pairs of rewards/chosen, rewards/rejected, rewards/accuracies (chosen above
rejected), rewards/margins, logps/chosen, logps/rejected (for SimPO and ORPO per-token means, as TRL's CPO and ORPO
log them), and for ORPO nll_loss, log_odds_ratio and log_odds_chosen; the means over the step's completion tokens
of logits/chosen and logits/rejected (the vocabulary's mean logit on each side's tokens), entropy (both sides) and
mean_token_accuracy (the chosen side's tokens that are the argmax), as TRL's DPOTrainer computes them (it averages
each micro-batch's, here the step's tokens are weighed alike); `num_tokens` counts the scored completion tokens and
`conversations` the pairs. --eval_dataset's pairs give the same metrics on the eval split (train/step/evaluate.py).

Where the flags leave it to the data (`resolve_preference`), a dataset of `chosen` and `rejected` columns trains
DPO, and preference rows are packed (several pairs a row, never attending to each other) unless --packing false.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ...data.pair_packing import preference_batch
from ...levers.preference_loss import PreferenceObjective, PreferenceSpec, pair_stats, pair_terms, step_means
from ...sp.sharding import shard_sequence
from ..step.loop import forward_backward
from ..step.shards import shard_batch
from ..step.step_kind import StepKind

_SFT_FORMAT_FLAGS = ("data_format", "text_column", "messages_field", "loss_on")


def resolve_preference(cfg, explicit: set[str]) -> Optional[str]:
    """What the flags leave to the data, settled before the checks (TrainConfig.validate): --method follows from
    the dataset where it is unambiguous (one dataset with `chosen` and `rejected` columns and none of the SFT format
    flags: DPO, as TRL's DPOTrainer reads such data), and preference rows are packed unless --packing is given.
    Returns the log's line about a --method the data chose, or None."""
    from ...data.corpus import peek_columns
    from ...data.mixture import dataset_entries, is_mixture

    note = None
    data = cfg.data
    if "method" not in explicit and data.dataset and not any(f in explicit for f in _SFT_FORMAT_FLAGS):
        entries = dataset_entries(data.dataset)
        if not is_mixture(entries):
            columns = peek_columns(entries[0].path, entries[0].split or data.dataset_split) or []
            if "chosen" in columns and "rejected" in columns:
                cfg.pref.method = "dpo"
                note = (f"--method dpo: --dataset {entries[0].path} holds preference pairs (columns `chosen` and "
                        f"`rejected`); give --method simpo, orpo or sft to train otherwise")
    if cfg.pref.method != "sft" and "packing" not in explicit:
        data.packing = True  # several pairs a row; --packing false keeps one pair a row
    return note


def preference_spec(cfg) -> Optional[PreferenceSpec]:
    """The run's loss, or None for SFT."""
    pref = cfg.pref
    if pref.method == "sft":
        return None
    return PreferenceSpec(pref.method, pref.beta, pref.loss_type, pref.simpo_gamma)


def shard_segments(run, batch: dict) -> torch.Tensor:
    """This rank's shard of the batch's `segments`, shifted and padded as the labels are (sp/sharding.py)."""
    g = run.groups
    return shard_sequence(batch["input_ids"], g.sp_size, g.sp_rank, labels=batch["segments"],
                          ring_size=g.ring_size)["labels"].to(run.device)


def step_counts(run, batches: list[dict]) -> torch.Tensor:
    """[scored tokens, pairs, chosen scored tokens] of a whole optimizer step (every micro-batch of every DP rank):
    the normalisers, counted from the whole rows every rank of an SP group holds."""
    counts = torch.tensor([[int((b["segments"] >= 0).sum()), len(b["scored"]), int(b["scored"][:, 0].sum())]
                           for b in batches], dtype=torch.float64, device=run.device).sum(dim=0)
    if run.groups.dp_size > 1:
        dist.all_reduce(counts, group=run.groups.dp_group)
    return counts


def objective_for(run, batch: dict, counts: torch.Tensor) -> PreferenceObjective:
    reference = batch.get("reference")
    return PreferenceObjective(run.spec, shard_segments(run, batch), batch["scored"].to(run.device), reference,
                               pairs_total=float(counts[1]), chosen_tokens_total=max(1.0, float(counts[2])),
                               sp_group=run.groups.sp_group if run.groups.sp_size > 1 else None)


def accumulate(run, step: int, finish: bool = True) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """loop.accumulate_tokens for preference pairs: every micro-step of optimizer step `step` (1-based) and the
    optimizer step unless `finish` is False. Returns the loss, [scored tokens, pairs] and whether the step was skipped;
    leaves the step's metrics in `run.preference_stats`."""
    keys = run.spec.stat_keys()
    batches = [run.micro_batch(step - 1, m) for m in range(run.accum)]
    counts = step_counts(run, batches)
    total, skipped = torch.zeros((), device=run.device), False
    stats = torch.zeros(len(keys), dtype=torch.float64, device=run.device)
    for micro_step, batch in enumerate(batches):
        objective = objective_for(run, batch, counts)
        loss, skipped = forward_backward(run, batch, step, counts[0], objective)
        if not skipped and (finish or micro_step < run.accum - 1):
            run.engine.step()
        total += loss
        stats += torch.tensor([objective.stats.get(k, 0.0) for k in keys], dtype=torch.float64, device=run.device)
    if run.groups.dp_size > 1:  # every rank of an SP group holds the same stats: sum one per group
        dist.all_reduce(total, group=run.groups.dp_group)
        dist.all_reduce(stats, group=run.groups.dp_group)
    run.preference_stats = step_means({k: float(v) for k, v in zip(keys, stats)}, float(counts[1]),
                                      float(counts[2]), float(counts[0]))
    return total, counts[:2], skipped


def evaluate_pairs(run, source, reference: Optional[np.ndarray], max_samples: Optional[int]) -> dict:
    """--eval_dataset's pairs (train/step/evaluate.py's loop: forward only under SP, each DP group every dp-th
    micro-batch, rows past the end run but not counted): the training objective's loss over the eval pairs (the
    pair terms' mean; ORPO adds the chosen tokens' NLL mean) and the metrics TRL logs, as eval_<name>."""
    g, micro, spec = run.groups, run.micro, run.spec
    n = source.num_samples if max_samples is None else min(source.num_samples, max_samples)
    keys = spec.stat_keys()
    totals = torch.zeros(5 + len(keys), dtype=torch.float64, device=run.device)  # see _eval_sums
    run.engine.eval()
    try:
        with torch.no_grad():
            for first in range(0, n, micro * g.dp_size):
                indices = [first + g.dp_rank * micro + r for r in range(micro)]
                rows = [source.get(min(i, n - 1)) for i in indices]
                batch = preference_batch(rows, reference)
                shard = shard_batch(run, batch)
                objective = PreferenceObjective(spec, shard_segments(run, batch), batch["scored"].to(run.device),
                                                batch.get("reference"),
                                                sp_group=g.sp_group if g.sp_size > 1 else None)
                run.engine(shard["input_ids"], shard["position_ids"], shard["labels"],
                           torch.ones((), device=run.device), objective=objective)
                counted = torch.tensor([i < n for i, row in zip(indices, rows) for _ in row.pairs], device=run.device)
                if g.sp_rank == 0 and counted.any():  # every rank of an SP group holds the same sums: add them once
                    totals += _eval_sums(spec, objective, counted, keys)
    finally:
        run.engine.train()
    dist.all_reduce(totals)
    losses, nll, pairs, chosen, tokens = totals[:5].tolist()
    stats = dict(zip(keys, totals[5:].tolist()))
    loss = losses / max(1.0, pairs)
    if spec.method == "orpo":
        stats["nll_loss"] = nll / max(1.0, chosen)
        loss += stats["nll_loss"]
    means = step_means(stats, pairs, chosen, tokens)
    return {"eval_loss": loss if pairs else None, **{f"eval_{k}": v for k, v in means.items()},
            "eval_tokens": int(tokens), "eval_samples": n, "eval_pairs": int(pairs),
            "eval_micro_batches": -(-n // (micro * g.dp_size))}


def _eval_sums(spec: PreferenceSpec, objective: PreferenceObjective, counted: torch.Tensor, keys: tuple):
    """[pair losses, chosen sides' log-probs negated, pairs, chosen tokens, tokens, *stats] summed over a
    micro-batch's `counted` pairs."""
    sums, scored = objective.sums[counted], objective.scored[counted]
    reference = None if objective.reference is None else objective.reference[counted]
    terms = pair_terms(spec, sums, scored, reference)
    nll = -sums[:, 0].sum()
    stats = pair_stats(terms, objective.token_sums[counted], nll if spec.method == "orpo" else None)
    head = [float(terms["losses"].sum()), float(nll), float(len(sums)), float(scored[:, 0].sum()),
            float(scored.sum())]
    return torch.tensor(head + [stats.get(k, 0.0) for k in keys], dtype=torch.float64, device=sums.device)


def unpack_pairs(batch: dict) -> list[dict]:
    """Each pair of a batch as TRL sees it, in the batch's pair order: `prompt_chosen`, `prompt_rejected` (n,) token
    ids, `chosen_mask`, `rejected_mask` (n,) 1 on the scored tokens, `ref` (2,) or None (for the checks that run
    plain transformers on whole pairs)."""
    pairs: dict = {}
    for r, lengths in enumerate(batch["docs"]):
        start = 0
        for n in lengths:
            seg = batch["segments"][r, start:start + n]
            scored = seg[seg >= 0]
            if len(scored):  # a side (the padding scores nothing)
                k = int(scored[0])
                name = ("chosen", "rejected")[k % 2]
                pairs.setdefault(k // 2, {})[f"prompt_{name}"] = batch["input_ids"][r, start:start + n]
                pairs[k // 2][f"{name}_mask"] = (seg >= 0).long()
            start += n
    reference = batch.get("reference")
    out = [pairs[k] | {"ref": None if reference is None else reference[k]} for k in sorted(pairs)]
    if len(out) != len(batch["scored"]) or any(len(pair) != 5 for pair in out):
        raise RuntimeError("a pair of the batch lacks a side")
    return out


def _evaluate_run_pairs(run, source, max_samples: Optional[int]) -> dict:
    return evaluate_pairs(run, source, run.eval_reference, max_samples)


PAIRS = StepKind(accumulate, _evaluate_run_pairs)  # the trainer's step_kind for --method dpo|simpo|orpo
