"""Before the model is built: whether this run, with the levers the policy resolved, fits the device by the planner's
memory estimate (levers/memory.py), and where it does not, a warning that names what would fit.

Every `auto` lever already chooses what fits where something does; a run that still does not fit is one whose model
states or sequence are too large for the device (Qwen3.5-9B's 67.5 GiB of states at 65,536 tokens on an 80 GB GPU).
It warns rather than refuses: the estimate is within a few percent on the families it is fitted on, not on every
other, and a user may know better. Without it such a run builds for minutes and stops with CUDA's out-of-memory error
in its first steps, which names no setting.
"""
import dataclasses
import os
import shlex
import sys
from typing import Callable, Optional

from ...levers.memory import fits
from ...levers.policy import DeviceInfo, Levers
from ..config.groups import REPO_ROOT

GiB = 1024 ** 3
# the DeepSpeed config that moves the optimizer states to host memory (fp32 states, DeepSpeed's CPU Adam)
OFFLOAD_CONFIG = os.path.join(REPO_ROOT, "ds_configs", "zero3_offload.json")


def memory_warning(estimate_of: Callable[[Levers], dict], levers: Levers, device: DeviceInfo,
                   plan_flags: str) -> Optional[str]:
    """None where the estimate of `levers` fits `device` as the planner counts it (95% of the GPU, all of the host),
    else one line: the estimate against the device, the largest part, and what fits instead. `estimate_of`: the
    run's estimate as a function of the levers (trainer.run_estimate); `plan_flags`: the run's own command-line
    flags, for the planner command the line ends with."""
    if device.type != "cuda":
        return None
    est = estimate_of(levers)
    if fits(est, device.memory_bytes, device.host_memory_bytes):
        return None
    gpu_over = not fits(est, device.memory_bytes, device.host_memory_bytes, host=False)
    if gpu_over:
        part, size = max(est["gpu"].items(), key=lambda kv: kv[1])
        where = (f"{est['gpu_total'] / GiB:.1f} GiB per GPU of this GPU's {device.memory_bytes / GiB:.1f} "
                 f"(the most: {part}, {size / GiB:.1f} GiB)")
    else:
        where = (f"{est['host_total'] / GiB:.1f} GiB of host memory of this host's "
                 f"{device.host_memory_bytes / GiB:.1f} (offloaded checkpoints and optimizer states)")
    remedies = []
    if gpu_over and not levers.offload_optimizer:
        moved = estimate_of(dataclasses.replace(levers, offload_optimizer=True, bf16_states=False))
        if fits(moved, device.memory_bytes, device.host_memory_bytes):
            remedies.append(f"--ds_config {os.path.relpath(OFFLOAD_CONFIG)} (optimizer states in host memory: "
                            f"{moved['gpu_total'] / GiB:.1f} GiB per GPU, slower steps)")
    if gpu_over and not levers.offload_activations:
        remedies.append("--offload_activations (checkpoints in host memory)")
    remedies.append("more GPUs (--sp_size) or a shorter --seq_len: `python -m ulysses_train.plan --gpus N -- "
                    f"{plan_flags}` says which fit")
    return (f"this run does not fit by the planner's memory estimate: {where}; it may stop with CUDA out of memory in "
            "its first steps. Options: " + "; ".join(remedies))


def run_flags(argv: Optional[list] = None) -> str:
    """This process's command-line flags as a user would type them again (the launcher's --local_rank left out)."""
    argv = sys.argv[1:] if argv is None else argv
    return " ".join(shlex.quote(a) for a in argv if not a.startswith("--local_rank"))


def explicit_flags(cfg, explicit: set) -> str:
    """The flags a run was given (from the command line, a config file or the Python API), in the reference's order,
    as a user would type them: a true switch alone, lists space-separated."""
    from ..config.groups import FLAGS

    words = []
    for name in (n for n in FLAGS if n in explicit):
        value = cfg.get(name)
        if value is True:
            words.append(f"--{name}")
        elif isinstance(value, (list, tuple)):
            words += [f"--{name}", *(shlex.quote(str(v)) for v in value)]
        else:
            words += [f"--{name}", shlex.quote(str(value).lower() if isinstance(value, bool) else str(value))]
    return " ".join(words)
