"""Where a training step's time goes: wall time per phase, and GPU time per kind of kernel from the torch profiler.

Used by step_bench.py (`--phases`, `--profile_step N`). Phases are timed with a device synchronise at each
boundary (forward+loss, backward with recompute, optimizer step), on every step. The profiler runs for one step
and files each GPU kernel under the first of these that its launching op (or an op above it) matches:

    optimizer      under `ulysses/optimizer_step` (the engine's step: unscale, clip, Adam, cast)
    loss           under `ulysses/loss` (the fused chunked head + cross-entropy)
    attention_fwd  an attention kernel's forward op (cuDNN, flash, efficient SDPA, flash_attn)
    attention_bwd  its backward op
    all_to_all     an NCCL kernel under an all-to-all op
    collective     any other NCCL kernel (ZeRO gathers and reductions)
    copy_host      host<->device copies (offloaded checkpoints)
    matmul         GEMM kernels (linear layers, forward, recompute and backward)
    other          everything else: norms, activations, rotary, casts, adds

Our own module, because no tool we use splits a step this way; the profiler gives the raw events."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

from ulysses_train.phases import wrap_phases

ATTN_FWD = ("scaled_dot_product_cudnn_attention", "scaled_dot_product_flash_attention",
            "scaled_dot_product_efficient_attention", "flash_attn_forward", "flash_attn_varlen_forward",
            "flash_attn_func", "_flash_attn_fwd")
GEMM_HINTS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "wgmma")


def _is_attention_op(name: str) -> bool:
    return any(op in name for op in ATTN_FWD)


def kernel_category(kernel_name: str, ancestors: list[str]) -> str:
    """ancestors: op names from the launching op outwards."""
    joined = " | ".join(ancestors)
    k = kernel_name.lower()
    if "ulysses/optimizer_step" in joined:  # an offloaded optimizer's copies are the optimizer's
        return "optimizer"
    # host copies before attention: the kept attention outputs go to the host from inside the attention op's
    # dispatch (on a side stream), so by their ancestors alone they would be filed as attention forward
    if "memcpy" in k and ("dtoh" in k or "htod" in k):
        return "copy_host"
    if "ulysses/loss" in joined:
        return "loss"
    for name in ancestors:
        if _is_attention_op(name):
            return "attention_bwd" if "backward" in name.lower() or "bwd" in name.lower() else "attention_fwd"
    if "nccl" in k:
        return "all_to_all" if "all_to_all" in joined or "alltoall" in k else "collective"
    if any(h in k for h in GEMM_HINTS):
        return "matmul"
    return "other"


def _ancestors(event) -> list[str]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def categorise(prof) -> dict[str, float]:
    """Seconds of GPU kernel time per category, from a finished torch.profiler.profile."""
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.events():
        for kernel in getattr(event, "kernels", []):
            seconds[kernel_category(kernel.name, _ancestors(event))] += kernel.duration / 1e6
    return dict(seconds)


class PhaseTimer:
    """Times the engine's forward, backward and step with device synchronisation at each boundary, and marks them
    (and the loss head) as profiler ranges. `times`: one {"forward", "backward", "step": seconds} per optimizer step."""

    LABELS = {"forward": "ulysses/forward", "backward": "ulysses/backward", "optimizer": "ulysses/optimizer_step",
              "loss": "ulysses/loss"}

    def __init__(self, engine, loss_module=None):
        self.times: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        wrap_phases(engine, loss_module, self._phase)

    @contextlib.contextmanager
    def _phase(self, phase: str):
        if phase == "loss":  # inside the forward: a profiler range, not a timer of its own
            with torch.profiler.record_function(self.LABELS[phase]):
                yield
            return
        name = "step" if phase == "optimizer" else phase
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.profiler.record_function(self.LABELS[phase]):
            yield
        torch.cuda.synchronize()
        self._current[name] = self._current.get(name, 0.0) + time.perf_counter() - start
        if name == "step":
            self.times.append(self._current)
            self._current = {}


@contextlib.contextmanager
def profile_one_step(trainer, step: int, trace_path: str | None):
    """Profiles step `step` (1-based) of trainer.train(); yields a dict that holds the categories afterwards."""
    from torch.profiler import ProfilerActivity, profile, schedule

    result: dict = {}
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=step - 1, warmup=0, active=1, repeat=1))
    original = trainer.train_micro_step

    def stepping(*args, **kwargs):
        out = original(*args, **kwargs)
        prof.step()
        return out

    trainer.train_micro_step = stepping
    prof.start()
    try:
        yield result
    finally:
        prof.stop()
        trainer.train_micro_step = original
        result.update(categorise(prof))
        if trace_path:
            prof.export_chrome_trace(trace_path)
