"""The training loop: steps of micro-steps of forward and backward through the DeepSpeed engine.

What is not training lives in the module that owns it and hooks in here: faults.py (NaN checks, SIGTERM, injected
faults), memory_profile.py (`--profile_memory`), levers/offload.py (its own bookkeeping per backward), metrics.py.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..levers.loss import global_token_count
from ..sp.sharding import shard_sequence
from .faults import StopFlag, check_grad_norm, inject_at_step, loss_is_skipped
from .memory_profile import ProfileFirstSteps
from .metrics import MetricsLogger, device_peak_gib, host_peak_gib


def forward_backward(run, batch: dict, step: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One batch of whole sequences: this rank's shard forward and backward. Returns the SP group's loss, its valid
    tokens, and whether the step is skipped (a non-finite loss under --skip_nonfinite)."""
    g = run.groups
    pad_id = getattr(run.tokenizer, "pad_token_id", None) or 0
    shard = {k: v.to(run.device) for k, v in shard_sequence(  # (b, s) -> (b, s/sp) each
        batch["input_ids"], g.sp_size, g.sp_rank, labels=batch["labels"], position_ids=batch["position_ids"],
        pad_token_id=pad_id).items()}
    padded = shard["input_ids"].shape[1] * g.sp_size - batch["input_ids"].shape[1]
    docs = batch["docs"]  # the padding added for sp is one more (ignored) document
    run.attention.doc_lengths = [row + [padded] for row in docs] if docs is not None and padded else docs
    normalizer = global_token_count(shard["labels"], g.sp_group)
    loss = run.engine(shard["input_ids"], shard["position_ids"], shard["labels"], normalizer)
    if loss_is_skipped(loss, step, run.cfg.skip_nonfinite):
        return loss.detach(), normalizer, True
    run.engine.backward(loss * run.backward_scale)
    if run.offload is not None:
        run.offload.reset()
    total = loss.detach().float()
    if g.sp_size > 1:
        dist.all_reduce(total, group=g.sp_group)
    return total, normalizer, False


def train_step(run, step: int) -> dict:
    """Optimizer step `step` (1-based): its micro-steps, the engine's steps, and its metrics record."""
    g, device = run.groups, run.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    stats, skipped = torch.zeros(2, device=device), False  # (loss summed over micro-steps, valid tokens)
    for micro_step in range(run.accum):
        loss, count, skipped = forward_backward(run, run.micro_batch(step - 1, micro_step), step)
        if not skipped:
            run.engine.step()
        stats += torch.stack([loss / run.accum, count])
    if g.dp_size > 1:
        dist.all_reduce(stats, group=g.dp_group)
    sync()
    elapsed = time.perf_counter() - start
    grad_norm = float(run.engine.get_global_grad_norm() or 0.0)
    check_grad_norm(grad_norm, step, skipped, run.cfg.skip_nonfinite)
    return {"step": step, "loss": stats[0].item() / g.dp_size, "grad_norm": grad_norm,
            "num_tokens": int(stats[1].item()), "step_time_s": elapsed,
            "tokens_per_s": run.seq_len * run.micro * run.accum * g.dp_size / elapsed,
            "peak_mem_gib": device_peak_gib(device), "lr": run.engine.get_lr()[0], "skipped": skipped}


def train(run) -> list[dict]:
    """Steps from the one after the resumed checkpoint to --steps; saves every --save_steps, after the last step
    (--save_final) and on SIGTERM."""
    cfg, history = run.cfg, []
    stop = StopFlag()
    with MetricsLogger(cfg.output_dir, cfg.steps, run.rank == 0, cfg.tensorboard, cfg.log_every,
                       run.start_step) as logger, ProfileFirstSteps(run, cfg.profile_memory, logger.write) as profile:
        for step in range(run.start_step + 1, cfg.steps + 1):
            inject_at_step(step, run.rank)
            profile.before_step(step)
            record = train_step(run, step)
            profile.after_step(step)
            history.append(record)
            logger.log(record, {"host_peak_gib": host_peak_gib(), "skipped": record["skipped"],
                                "host_offload_gib": run.offload.peak_host_bytes / 2**30 if run.offload else 0.0})
            if record["skipped"]:
                logger.write(f"step {step}: non-finite loss, step skipped (--skip_nonfinite)")
            saved = bool(cfg.save_steps and step % cfg.save_steps == 0) or (step == cfg.steps and cfg.save_final)
            if saved:
                run.save(step)
            if stop.agreed(run.device):
                if not saved:
                    run.save(step)
                logger.write(f"{stop.signal_name or 'SIGTERM'} received: saved step {step}, exiting; relaunch with "
                             f"--resume auto to continue")
                break
    return history

