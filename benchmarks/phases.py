"""Where a training step's time goes: wall time per phase, and GPU time per kind of kernel from the torch profiler.

Used by step_bench.py (`--phases`, `--profile_step N`). Phases are timed with a device synchronise at each
boundary (forward+loss, backward with recompute, optimizer step), on every step. The profiler runs for one step
and files each GPU kernel (each once, from the GPU's own events) under the first of these that its name or its
launching op (or an op above it) matches:

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

from ulysses_train.train.step.phases import wrap_phases

ATTN_FWD = ("scaled_dot_product_cudnn_attention", "scaled_dot_product_flash_attention",
            "scaled_dot_product_efficient_attention", "flash_attn_forward", "flash_attn_varlen_forward",
            "flash_attn_func", "_flash_attn_fwd", "ulysses::fa4")  # ulysses::fa4_fwd and ulysses::fa4_bwd
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
    # attention kernels by name first: FA4's kernels are launched through the CUDA driver from Python, and the
    # profiler links some of them to a neighbouring op (7 of 36 backward and 2 of 36 forward kernels in one 64k step)
    if "flash_fprop" in k or "flashattentionforward" in k:
        return "attention_fwd"
    if "flash_bprop" in k or "flashattentionbackward" in k:
        return "attention_bwd"
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


def categorise(prof, top: int = 80) -> dict:
    """From a finished torch.profiler.profile: seconds of GPU time per category (`categories`), and the `top`
    kernels by time as [category, kernel name, launches, seconds] (`top`), to see what a category holds."""
    launchers: dict[int, tuple[int, list[str]]] = {}  # correlation id -> (depth, ancestors) of the launching op
    for event in prof.events():
        ancestors = _ancestors(event)
        if event.id not in launchers or len(ancestors) > launchers[event.id][0]:
            launchers[event.id] = (len(ancestors), ancestors)
    kernels = [(e.name(), e.duration_ns() / 1e9, e.linked_correlation_id()) for e in _gpu_events(prof)]
    return categorise_kernels(kernels, {cid: anc for cid, (_, anc) in launchers.items()}, top)


def categorise_kernels(kernels: list[tuple[str, float, int]], launchers: dict[int, list[str]], top: int = 40) -> dict:
    """kernels: (name, seconds, correlation id of the launch), each GPU kernel or copy once; launchers: correlation
    id -> op names from the launching op outwards. Why from the GPU events and not from each op's kernel list: the
    profiler hands a kernel to every op event that carries the launch's correlation id, and an op re-dispatched by a
    TorchDispatchMode (the checkpoint's caching mode, our offload of kept outputs) carries it twice; counted per op,
    34 of 36 attention forwards of a 64k step come out twice (4.07 s against the 2.08 s of the 36 kernels in
    the Chrome trace)."""
    seconds: dict[str, float] = defaultdict(float)
    by_kernel: dict[tuple[str, str], list] = {}
    for name, secs, correlation in kernels:
        category = kernel_category(name, launchers.get(correlation, []))
        seconds[category] += secs
        entry = by_kernel.setdefault((category, name[:120]), [0, 0.0])
        entry[0] += 1
        entry[1] += secs
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]
    return {"categories": dict(seconds), "top": [[c, n, k, round(s, 4)] for (c, n), (k, s) in ranked]}


def _gpu_events(prof) -> list:
    """Kernels, copies and memsets on the GPU; not the GPU-side ranges of our record_function annotations."""
    return [e for e in prof.profiler.kineto_results.events()
            if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
            and not e.is_user_annotation() and not e.name().startswith(("ProfilerStep#", "ulysses/"))]


def busy_seconds(intervals: list[tuple[int, int]]) -> float:
    """Length of the union of [start, end) intervals given in nanoseconds, in seconds."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total / 1e9


def stream_busy(prof) -> dict:
    """How busy the GPU was during the profiled step: per CUDA stream, the union of its kernels' and copies'
    intervals, and the union over all streams (`any`), next to the span from first to last GPU event (`span`).
    The main stream's idle time is time the step waited on the host (launches, synchronisations)."""
    per_stream: dict[str, list] = defaultdict(list)
    for event in _gpu_events(prof):
        per_stream[f"stream {event.device_resource_id()}"].append((event.start_ns(), event.end_ns()))
    everything = [iv for ivs in per_stream.values() for iv in ivs]
    if not everything:
        return {}
    result = {name: round(busy_seconds(ivs), 3) for name, ivs in per_stream.items()}
    result["any"] = round(busy_seconds(everything), 3)
    result["span"] = round((max(e for _, e in everything) - min(s for s, _ in everything)) / 1e9, 3)
    return result


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
    """Profiles micro-step `step` (1-based) of the training loop (one optimizer step without accumulation); yields a
    dict that holds the categories afterwards."""
    from torch.profiler import ProfilerActivity, profile, schedule

    result: dict = {}
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=step - 1, warmup=0, active=1, repeat=1))
    original = trainer.engine.step  # called once per micro-step by the loop

    def stepping(*args, **kwargs):
        out = original(*args, **kwargs)
        prof.step()
        return out

    trainer.engine.step = stepping
    prof.start()
    try:
        yield result
    finally:
        prof.stop()
        trainer.engine.step = original
        if prof.profiler is None:  # stopped (SIGTERM, an error) before the profiled step: nothing recorded
            print(f"profile: step {step} was not reached, no kernels recorded", flush=True)
        else:
            result.update(categorise(prof))
            result["streams"] = stream_busy(prof)
            if trace_path:
                prof.export_chrome_trace(trace_path)
