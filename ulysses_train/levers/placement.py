"""Where each checkpointed layer's saved tensors live, and how many layers hold a checkpoint at all.

Two resolved levers (levers/policy.py `Levers`), each with a flag and an `auto` chosen on the planner's memory
estimate (levers/memory.py):

`gpu_checkpoints` (`--gpu_checkpoints auto|N|all`, with `--offload_activations`): the last N checkpointed layers
keep what they save (their input, and kept attention outputs) on the GPU, the others send it to pinned host memory
as before. Why a split: offloading every checkpoint leaves most of the GPU empty while the host runs out first
(Qwen3-8B on one H200: host-bound near 420k tokens with ~100 GiB of the GPU unused). `auto` leaves every
checkpoint on the host while the host holds them all (their copies overlap compute, so keeping some on the GPU would
only raise its peak); when it does not, it keeps as many on the GPU as fit after the working set (model states, the
largest layer's working memory, the loss head; within GPU_CHECKPOINT_FRACTION of the device, a margin beyond the
estimate's own 95% for the two offloaded layers in flight and the allocator's fragments between long-lived checkpoints).

Why the LAST layers: the backward consumes them first, so it starts on checkpoints already on the GPU while the
first host copies come back, and every offloaded checkpoint (an early layer's) has the whole backward of the
GPU-resident layers to come back in, and in the forward every later layer's compute to go out in. The early layers'
checkpoints are also the longest-lived (written first, read last): those are the ones worth moving. (Megatron and NeMo's
`cpu_offloading_num_layers` offload the first N layers and keep the last on the GPU, the same order; DeepSpeed's
`cpu_checkpointing` and ALST offload every checkpoint.)

`checkpoint_every` (`--checkpoint_every auto|K`): where GPU and host together still do not hold a checkpoint per
layer, only every K-th layer (the first of each segment of K) keeps its input; the others' inputs are regenerated
in the backward from the segment's checkpoint (levers/segments.py) by running the segment's layers forward once
more without a gradient, just before the segment's last layer recomputes: K - 1 extra layer forwards per segment
(the time model books them), K - 1 hidden states at once on the GPU, and a checkpoint per K layers instead of per
layer. Kept attention outputs stay per layer: the regenerating forward does not use them. `auto` takes the
smallest K that fits, only with the offload (without it the planner's other levers come first), and only up to
about sqrt(layers): past it the regenerated inputs held at once cost more than the checkpoints saved.
Compact (fp8) checkpoints would be the next step; not built.

Layer i of the checkpointed ones (0-based, `n` of them):
    saves its input        i % K == 0
    regenerates its output i % K != K - 1 and i != n - 1 (the next layer of its segment needs it)
    on the host            offload and i < n - gpu_checkpoints
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import ConfigError

# --gpu_checkpoints auto keeps checkpoints on the GPU while the planner's estimate of the whole run stays under
# this share of the device (the estimate's fit is 95%: this leaves room for the prefetched layers and fragments)
GPU_CHECKPOINT_FRACTION = 0.9


@dataclass(frozen=True)
class LayerPlace:
    """What one decoder layer saves for its backward and where (`layer_places`)."""

    checkpointed: bool
    saves_input: bool = True  # holds its input as a checkpoint (a segment's first layer)
    on_host: bool = False  # what it saves goes to pinned host memory
    regenerates: bool = False  # runs forward once more in the backward, for the next layer of its segment
    keeps_projections: bool = False  # keeps its projections' outputs (`--keep_projections`: the first layers)


def layer_places(levers, layers: int) -> list[LayerPlace]:
    """Per decoder layer, in order: what the memory estimate counts, the time model times and the surgery
    installs, from the same rule (the module docstring's table)."""
    n = levers.checkpointed(layers)
    k = max(1, getattr(levers, "checkpoint_every", 1))
    first_on_gpu = n - min(getattr(levers, "gpu_checkpoints", 0), n) if levers.offload_activations else 0
    places = []
    for i in range(layers):
        if i >= n:
            places.append(LayerPlace(False, saves_input=False))
            continue
        places.append(LayerPlace(True, saves_input=i % k == 0, on_host=levers.offload_activations and i < first_on_gpu,
                                 regenerates=i % k != k - 1 and i != n - 1 and k > 1,
                                 keeps_projections=i < getattr(levers, "keep_projections", 0)))
    return places


def count_flag(value: str, flag: str, layers: int, low: int = 0) -> Optional[int]:
    """`--gpu_checkpoints` / `--checkpoint_every` as typed: None for auto, `layers` for all, else a number from
    `low` to `layers`; anything else is an error naming the flag."""
    if value == "auto":
        return None
    if value == "all":
        return layers
    if not str(value).isdigit() or not low <= int(value) <= layers:
        raise ConfigError(f"{flag} must be auto, all or a number from {low} to {layers} (the model's layers), got "
                          f"{value!r}")
    return int(value)


def _why(levers, lever: str, text: str):
    return dataclasses.replace(levers, why={**levers.why, lever: text}) if text else levers


def place_checkpoints(levers, mode: str, layers: int, cuda: bool, fits: Optional[Callable[..., bool]]):
    """The levers with `gpu_checkpoints` resolved: 0 without the offload (everything is on the GPU already), the
    number asked, or under auto 0 while the whole run fits with every checkpoint on the host, else the most of the
    checkpointed layers whose checkpoints fit on the GPU beside the
    working set (`fits(levers, share, host=False)`: the planner's estimate of the GPU alone). The GPU's share only
    grows with the count, so the most that fit are found by bisection."""
    n = levers.checkpointed(layers)
    asked = count_flag(mode, "--gpu_checkpoints", layers)
    if not (levers.offload_activations and levers.checkpointing):
        return dataclasses.replace(levers, gpu_checkpoints=0)
    if asked is not None:
        return dataclasses.replace(levers, gpu_checkpoints=min(asked, n))
    if not cuda or fits is None:
        return _why(dataclasses.replace(levers, gpu_checkpoints=0), "gpu_checkpoints",
                    "auto: every checkpoint on the host (no GPU estimate)")
    if fits(dataclasses.replace(levers, gpu_checkpoints=0)):
        return _why(dataclasses.replace(levers, gpu_checkpoints=0), "gpu_checkpoints",
                    "auto: every checkpoint on the host, which holds them (their copies are hidden behind compute)")

    def fit(g: int) -> bool:
        return fits(dataclasses.replace(levers, gpu_checkpoints=g), GPU_CHECKPOINT_FRACTION, host=False)

    lo, hi = 0, n  # fit(lo) or lo == 0; find the largest g with fit(g)
    if fit(n):
        lo = n
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fit(mid) else (lo, mid)
    return _why(dataclasses.replace(levers, gpu_checkpoints=lo), "gpu_checkpoints",
                f"auto: the last {lo} of {n} checkpointed layers keep theirs on the GPU (the most under "
                f"{GPU_CHECKPOINT_FRACTION:.0%} of the device), {n - lo} on the host")


def max_segment(layers: int) -> int:
    """The longest segment `--checkpoint_every auto` tries: past about sqrt(layers) the K - 1 regenerated inputs
    held at once outweigh the checkpoints saved (n/K + K - 1 is least near K = sqrt(n))."""
    return min(layers, max(2, math.isqrt(layers)))


def segment_checkpoints(levers, mode: str, gpu_mode: str, layers: int, cuda: bool,
                        fits: Optional[Callable[..., bool]]):
    """`--checkpoint_every` and then `--gpu_checkpoints`: a number as given; auto is 1 (a checkpoint per layer)
    unless the offloaded run does not fit (GPU and host, `fits(levers)`), then the smallest K up to `max_segment`
    that fits, each K with its checkpoints placed anew."""
    n = levers.checkpointed(layers)
    asked = count_flag(mode, "--checkpoint_every", layers, low=1) if levers.checkpointing else 1

    def placed(k: int):
        return place_checkpoints(dataclasses.replace(levers, checkpoint_every=k), gpu_mode, layers, cuda, fits)

    if asked is not None:
        return placed(min(asked, max(n, 1)))
    one = placed(1)
    if not (levers.offload_activations and cuda and fits is not None) or n < 2 or fits(one):
        return one
    top = max_segment(n)
    for k in range(2, top + 1):  # more recompute with every k: the first that fits is the fastest that fits
        candidate = placed(k)
        if fits(candidate):
            return _why(candidate, "checkpoint_every",
                        f"auto: every {k} layers (a checkpoint per layer does not fit on GPU and host; "
                        f"{math.ceil(n / k)} checkpoints, {k - 1} more layer forward{'s' if k > 2 else ''} a "
                        f"segment)")
    return _why(one, "checkpoint_every", f"auto: every layer (segments of up to {top} layers do not fit either)")
