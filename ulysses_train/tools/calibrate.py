"""Measures the time model's constants on this machine (`python -m ulysses_train.plan --calibrate FILE`).

What it measures, each with a short run, and writes into a JSON that `--constants FILE` reads back:

    matmul       a square bf16 matmul (fp32 on the CPU), times the in-step shares the H200 steps showed for the
                 layers' linear layers and for the fused loss
    attention    the kernel `--attn_kernel auto` picks here, causal forward and forward+backward, in FLOP/s of the
                 time model's count (2 x T^2 x heads x head_dim forward, 2.5x that backward)
    host copy    pinned device -> host and host -> device copies (CUDA only)
    all-to-all   `all_to_all_single` over every rank, when started under torchrun with more than one (CUDA: NCCL)

Everything it does not measure keeps the H200 default, and the file lists what was measured (`measured`) so that a
reader can tell. On a CPU the rates are the CPU's own: a plan made with them describes this CPU, not a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

import torch

from ..levers.machine_constants import AttentionRates, Constants

# the layers' linear layers ran at 88-92% of the square-matmul ceiling in the profiled H200 steps, and the fused loss
# (LM-head matmuls with the softmax between) at 43% of it with our kernel and 67% with Liger-Kernel's
# (time_model.py): the same shares are applied here
H200_CEILING = 808.0
MATMUL_IN_STEP = Constants().matmul_tflops / H200_CEILING
LOSS_IN_STEP = Constants().loss_tflops / H200_CEILING
LIGER_LOSS_IN_STEP = Constants().liger_loss_tflops / H200_CEILING


def _seconds(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median wall time of `fn` after one warm-up call, synchronised on CUDA."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def matmul_tflops(device: torch.device) -> float:
    """The square-matmul ceiling, TFLOP/s."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / _seconds(lambda: a @ b, device, 10) / 1e12


def attention_rates(device: torch.device, kernel: str) -> AttentionRates:
    """Causal attention of the kernel the trainer would pick, at Qwen3's head geometry on CUDA (a small one on
    the CPU), through the same function the trainer calls (sp/kernels.py)."""
    from ..sp.kernels import KERNELS

    seq, heads, kv, dim = (16384, 32, 8, 128) if device.type == "cuda" else (1024, 4, 2, 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, heads, seq, dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, kv, seq, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    fn = KERNELS[kernel]

    def forward():
        with torch.no_grad():
            return fn(q, k, v, dim**-0.5)

    def forward_backward():
        fn(q, k, v, dim**-0.5).sum().backward()

    flops = 2 * seq * seq * heads * dim
    fwd = _seconds(forward, device, 5)
    both = _seconds(forward_backward, device, 5)
    # the causal rates measured here; the window and wide-head shares (not measured here) the H200's
    default = Constants().attention.get(kernel, AttentionRates(fwd=1.0, bwd=1.0))
    return dataclasses.replace(default, fwd=flops / fwd / 1e12, bwd=2.5 * flops / max(both - fwd, 1e-9) / 1e12)


def host_copy_gb_s(device: torch.device) -> float:
    """Pinned host <-> GPU copies of 1 GiB, the slower direction, GB/s."""
    n = 1 << 30
    gpu = torch.empty(n, dtype=torch.uint8, device=device)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    down = _seconds(lambda: host.copy_(gpu, non_blocking=True), device, 5)
    up = _seconds(lambda: gpu.copy_(host, non_blocking=True), device, 5)
    return n / max(down, up) / 1e9


def all_to_all_gb_s(device: torch.device) -> float:
    """`all_to_all_single` of 256 MiB per rank over the default group: bytes each rank sends to the others per
    second, GB/s."""
    import torch.distributed as dist

    world = dist.get_world_size()
    send = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    seconds = _seconds(lambda: dist.all_to_all_single(recv, send), device, 5)
    return send.numel() * (world - 1) / world / seconds / 1e9


def calibrate(path: str, log=print) -> Constants:
    """Measures what this machine can measure, writes the constants to `path` and returns them."""
    import torch.distributed as dist

    from ..sp.kernels import resolve_kernel

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    measured, values = [], {}
    ceiling = matmul_tflops(device)
    values["matmul_tflops"], values["loss_tflops"] = ceiling * MATMUL_IN_STEP, ceiling * LOSS_IN_STEP
    values["liger_loss_tflops"] = ceiling * LIGER_LOSS_IN_STEP
    measured.append(f"matmul ({ceiling:.3g} TFLOP/s square; x {MATMUL_IN_STEP:.2f} in a step, x {LOSS_IN_STEP:.2f} "
                    f"for our fused loss, x {LIGER_LOSS_IN_STEP:.2f} for Liger-Kernel's)")
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    kernel = resolve_kernel("auto", device.type, device.type == "cuda", capability)
    rates = attention_rates(device, kernel)
    values["attention"] = {**Constants().attention, kernel: rates}
    measured.append(f"attention {kernel} ({rates.fwd:.3g} / {rates.bwd:.3g} TFLOP/s forward / backward)")
    if device.type == "cuda":
        values["pcie_gb_s"] = host_copy_gb_s(device)
        measured.append(f"host copy ({values['pcie_gb_s']:.3g} GB/s)")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        rate = all_to_all_gb_s(device)
        nodes = dist.get_world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        values["network_gb_s" if nodes > 1 else "nvlink_gb_s"] = rate
        measured.append(f"all-to-all over {dist.get_world_size()} ranks ({rate:.3g} GB/s)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    constants = dataclasses.replace(Constants(), name=f"{name} (calibrated: {'; '.join(measured)})", **values)
    if not (dist.is_initialized() and dist.get_rank() != 0):
        with open(path, "w") as f:
            json.dump({**constants.to_json(), "measured": measured}, f, indent=1)
        log(f"wrote {path}: measured {'; '.join(measured)}; every other constant is the H200 default")
        if device.type == "cpu":
            log("no GPU here: these are the CPU's rates, and a plan made with them describes this CPU")
    return constants
