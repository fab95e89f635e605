"""The training loop: steps of micro-steps of forward and backward through the DeepSpeed engine.

What is not training lives in the module that owns it and hooks in here: faults.py (NaN checks, SIGTERM, injected
faults), memory_profile.py (`--profile_memory`), levers/offload.py (its own bookkeeping per backward), metrics.py.
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch
import torch.distributed as dist

from ...data.sources import trainable_tokens
from ..process.faults import check_grad_norm, inject_at_step, loss_is_skipped
from .evaluate import evaluate_tokens
from .memory_profile import ProfileFirstSteps
from .metrics import FirstStepTicker, MetricsLogger, device_peak_gib, host_peak_gib
from .shards import shard_batch
from .step_kind import StepKind


def step_counts(run, batches: list[dict]) -> torch.Tensor:
    """[trainable tokens, conversations] of a whole optimizer step, every micro-batch of every DP rank (one
    all-reduce). The tokens are the loss's denominator, so the loss is the mean over the global batch however the
    tokens fall (SFT data does not give every micro-batch the same count; a micro-batch or SP shard without any
    contributes zero). Counted from the whole sequences, which every rank of an SP group holds."""
    counts = torch.tensor([sum(trainable_tokens(b) for b in batches), sum(b.get("conversations", 0) for b in batches)],
                          dtype=torch.float64, device=run.device)  # exact far past fp32's 16.7M tokens a step
    if run.groups.dp_size > 1:
        dist.all_reduce(counts, group=run.groups.dp_group)
    return counts


def forward_backward(run, batch: dict, step: int, normalizer: torch.Tensor,
                     objective=None) -> tuple[torch.Tensor, bool]:
    """One batch of whole sequences: this rank's shard forward and backward. Returns the SP group's share of the
    step's loss (sum of its tokens' cross-entropy / `normalizer`; with a preference `objective`,
    train/preference/pairs.py, its loss), and whether the step is skipped (a non-finite loss under --skip_nonfinite)."""
    g = run.groups
    shard = shard_batch(run, batch)
    loss = run.engine(shard["input_ids"], shard["position_ids"], shard["labels"], normalizer.float().clamp(min=1.0),
                      **({"objective": objective} if objective is not None else {}))
    if loss_is_skipped(loss, step, run.cfg.optim.skip_nonfinite):
        return loss.detach(), True
    # DeepSpeed averages gradients over DP ranks and micro-steps; each share is already / the global count, so
    # undo the averaging to sum them (and sp_backward_scale makes the SP ranks' shares add up, see levers/loss.py)
    run.engine.backward(loss * (run.backward_scale * run.accum * g.dp_size))
    if run.offload is not None:
        run.offload.reset()
    total = loss.detach().float()
    if g.sp_size > 1:
        dist.all_reduce(total, group=g.sp_group)
    return total, False


def accumulate_tokens(run, step: int, finish: bool = True) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Every micro-step of optimizer step `step` (1-based), and the engine's optimizer step after the last unless
    `finish` is False (--verify stops before it). Returns the loss (the mean over the step's trainable tokens, on
    every rank), the counts ([trainable tokens, conversations], step_counts), and whether the step was skipped."""
    batches = [run.micro_batch(step - 1, m) for m in range(run.accum)]
    counts = step_counts(run, batches)
    normalizer = counts[0]
    total, skipped = torch.zeros((), device=run.device), False
    for micro_step, batch in enumerate(batches):
        loss, skipped = forward_backward(run, batch, step, normalizer)
        if not skipped and (finish or micro_step < run.accum - 1):
            run.engine.step()  # inside the accumulation only advances DeepSpeed's micro-step counter
        total += loss
    if run.groups.dp_size > 1:
        dist.all_reduce(total, group=run.groups.dp_group)
    return total, counts, skipped


TOKENS = StepKind(accumulate_tokens, evaluate_tokens)  # SFT; preference.PAIRS for pairs


def accumulate(run, step: int, finish: bool = True) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Optimizer step `step`'s micro-steps as the run's data trains them (train/step/step_kind.py)."""
    return run.step_kind.accumulate(run, step, finish)


def evaluate(run, source, max_samples) -> dict:
    """The eval set's loss and metrics as the run's data scores them (train/step/step_kind.py)."""
    return run.step_kind.evaluate(run, source, max_samples)


def train_step(run, step: int) -> dict:
    """Optimizer step `step` (1-based): its micro-steps, the engine's steps, and its metrics record (its quantities:
    metrics.py). The lr is the one this step's update used, read before the engine's step moves the scheduler on."""
    g, device = run.groups, run.device
    lr = run.engine.get_lr()[0]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    loss, counts, skipped = accumulate(run, step)
    sync()
    elapsed = time.perf_counter() - start
    grad_norm = float(run.engine.get_global_grad_norm() or 0.0)
    check_grad_norm(grad_norm, step, skipped, run.cfg.optim.skip_nonfinite)
    tokens, conversations = (int(c) for c in counts.tolist())
    positions = run.seq_len * run.micro * run.accum * g.dp_size
    record = {"step": step, "loss": loss.item(), "grad_norm": grad_norm, "num_tokens": tokens,
              "num_positions": positions, "conversations": conversations, "step_time_s": elapsed,
              "tokens_per_s": positions / elapsed, "trained_tokens_per_s": tokens / elapsed,
              "peak_mem_gib": device_peak_gib(device), "lr": float(lr), "skipped": skipped}
    if run.cfg.pref.method != "sft":  # rewards, margins, accuracies, log-probs: train/preference/pairs.py
        record["preference"] = run.preference_stats
    return record


def first_step_note(run) -> Optional[str]:
    """What makes the first step of this process slower than the next ones on a GPU, said before it starts (FLA's
    autotuning alone took 1-3 minutes at 64k on an H200), so a silent first step is not mistaken for a hang."""
    if run.device.type != "cuda":
        return None
    work = [name for name, used in (
        ("FlashAttention-4's kernels", run.kernel == "flash_attn_4"),
        ("FLA's DeltaNet kernels (autotuned on first use)", getattr(run.linear_kernel, "name", None) == "fla"),
        ("our Triton kernels", run.levers.fused_kernels),
        ("the pinned host pool of the offload", run.offload is not None)) if used]
    if not work:
        return None
    return f"the first step compiles and allocates what later steps reuse ({', '.join(work)}): it takes longer"


def train(run) -> list[dict]:
    """Steps from the one after the resumed checkpoint to --steps; saves every --save_steps, after the last step
    (--save_final) and on SIGTERM."""
    cfg, history, stop = run.cfg, [], run.stop
    steps, every_eval, output, log = cfg.optim.steps, cfg.eval.eval_steps, cfg.output, cfg.log
    stop.armed = True
    if stop.agreed(run.device):  # stopped while starting up (the launcher went away): nothing trained, nothing to save
        if run.trackers is not None:
            run.trackers.close()
        return history
    with MetricsLogger(output.output_dir, steps, run.rank == 0, run.trackers, log.log_every, run.start_step,
                       log.progress) as logger, ProfileFirstSteps(run, log.profile_memory, logger.write) as profile:
        note = first_step_note(run)
        if note:
            logger.write(note)
        for step in range(run.start_step + 1, steps + 1):
            inject_at_step(step, run.rank, stop)
            profile.before_step(step)
            first = note is not None and step == run.start_step + 1 and logger.enabled
            with FirstStepTicker(logger.write) if first else contextlib.nullcontext():
                record = train_step(run, step)
            profile.after_step(step)
            if run.eval_source is not None and (step == steps or (every_eval and step % every_eval == 0)):
                record |= evaluate(run, run.eval_source, cfg.eval.eval_samples)
            history.append(record)
            logger.log(record, {"host_peak_gib": host_peak_gib(), "skipped": record["skipped"],
                                "host_offload_gib": run.offload.peak_host_bytes / 2**30 if run.offload else 0.0,
                                **{k: v for k, v in record.items() if k.startswith("eval_")},
                                **record.get("preference", {})})
            if record["skipped"]:
                logger.write(f"step {step}: non-finite loss, step skipped (--skip_nonfinite)")
            saved = bool(output.save_steps and step % output.save_steps == 0) or (step == steps and output.save_final)
            if saved:
                run.save(step)
            if stop.agreed(run.device):
                if not saved:
                    run.save(step)
                logger.write(f"{stop.reason}: saved step {step}, exiting; relaunch with "
                             f"--resume auto to continue")
                break
    return history

