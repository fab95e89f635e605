"""The planner for preference training (--method dpo|simpo|orpo): a pair row's memory and step time, and DPO's
reference pass.

A row holds the two sides of a pair as documents (data/pair_packing.py); the planner takes the longest pair the
flags allow, two sides of --max_length (default --seq_len / 2), the rest of the row padding. Against an SFT row of
the same length:

- attention: two documents of --max_length attend within themselves, half the query-key pairs of one sequence of
  twice the length (levers/time_model.py counts the pairs per document);
- the head (levers/preference_loss.py) makes the logits twice: 8 x T x vocabulary x hidden FLOPs at our loss's
  rate instead of 6 (Liger's loss does not run for pairs), and holds the scored rows' hidden states and their
  gradient beside the full ones: counted as if every token were scored (it runs on the completions' tokens only,
  so a long prompt costs less than this; levers/memory.py: preference_loss_bytes, the estimate's `pairs`);
- DPO's reference pass: one forward of every row without a gradient, once per dataset (a cache hit costs
  nothing), below the training step in memory; its time per row is the forward's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ..levers.time_model import Constants, Run, forward_time, step_time


def pair_documents(seq_len: int, max_length: int, micro: int) -> tuple:
    """Per row of the micro-batch: the longest pair's two sides, then the padding."""
    sides = (max_length, max_length) + ((seq_len - 2 * max_length,) if seq_len > 2 * max_length else ())
    return tuple(sides for _ in range(micro))


def preference_step_time(run: Run, c: Constants = Constants(), scored: Optional[int] = None) -> dict:
    """step_time of a pair row (its documents in `run.docs`) with our head and its second pass over the logits.
    `scored`: the completion tokens of a rank's rows, the only ones the head runs on (levers/preference_loss.py);
    None counts every token, the bound for data the planner has not seen."""
    ours = dataclasses.replace(run, levers=dataclasses.replace(run.levers, loss_kernel="ours"))
    time = step_time(ours, c)
    t = run.micro * math.ceil(run.seq_len / run.sp)
    share = 1.0 if scored is None else min(scored, t) / t
    extra = 2 * t * run.g["vocab"] * run.g["hidden"] / (c.loss_tflops * 1e12) * run.accum
    head = (time["parts"]["loss"] + extra) * share  # step_time's loss part is the head on every token
    parts = dict(time["parts"], loss=head)
    total = time["total"] - time["parts"]["loss"] + head
    communication = parts["all-to-all"] + parts["exposed copies and collectives"]
    return {**time, "total": total, "parts": parts, "communication_share": communication / total,
            "reference_pass_row_s": forward_time(dataclasses.replace(ours, micro=1), c)}


def report_lines(method: str, max_length: int, time: dict, gpus: int, sp: int) -> list[str]:
    """The plan's lines for pairs: the layout and, for DPO, the reference pass."""
    lines = [f"preference ({method}): rows of two sides of up to {max_length:,} tokens (the prompt in both); the head "
             f"makes the logits twice, counted on every token"]
    if method == "dpo":
        row = time["reference_pass_row_s"]
        lines.append(f"  reference pass (once per dataset, forward only, {gpus // sp} row(s) at a time): {row:.2f} s "
                     f"per row, {1000 * row / (gpus // sp) / 60:.1f} min per 1,000 rows")
    return lines
