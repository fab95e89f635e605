"""Host <-> GPU copy rates as the offload makes them: into torch's pinned memory and into the offload's own registered
pool (levers/offload.py: PinnedPool), each alone and while bf16 matmuls keep the compute stream busy, as a layer's
kernels do while its saved tensors go out. The time model takes one rate for both directions (`pcie_gb_s`); this
says whether the in-step copies keep it.

    python benchmarks/host_copy_bench.py            # 1 GiB copies, 5 each; needs a CUDA GPU
"""

from __future__ import annotations

import argparse
import time

import torch

from ulysses_train.levers.offload import PinnedPool


def copy_gb_s(copy, nbytes: int, reps: int, busy: torch.Tensor | None = None) -> float:
    """GB/s of `reps` calls of `copy` on a side stream; with `busy`, matmuls of it queued first on the compute
    stream, enough to outlast the copies."""
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    if busy is not None:
        for _ in range(120):  # 120 x 8,192^3 x 2 FLOPs: about 0.2 s on an H100, the copies about 0.1 s
            busy @ busy
    start = time.perf_counter()
    with torch.cuda.stream(side):
        for _ in range(reps):
            copy()
    side.synchronize()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return reps * nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="size of one copy, GiB")
    parser.add_argument("--reps", type=int, default=5, help="copies per measurement")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_copy_bench.py measures host <-> GPU copies: it needs a CUDA GPU")
    n = int(args.gib * (1 << 30))
    gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
    matrix = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    pool = PinnedPool(pin=True)
    hosts = {"torch pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True),
             "offload pool": pool.take((n,), torch.uint8)}
    copy_gb_s(lambda: hosts["torch pinned"].copy_(gpu, non_blocking=True), n, 2)  # warm-up
    print(f"{torch.cuda.get_device_name()}, {args.gib:g} GiB copies, GB/s")
    print("| host memory | to host | to GPU | to host beside matmuls | to GPU beside matmuls |")
    print("|---|---|---|---|---|")
    for name, host in hosts.items():
        def down():
            return host.copy_(gpu, non_blocking=True)

        def up():
            return gpu.copy_(host, non_blocking=True)

        rates = [copy_gb_s(down, n, args.reps), copy_gb_s(up, n, args.reps),
                 copy_gb_s(down, n, args.reps, matrix), copy_gb_s(up, n, args.reps, matrix)]
        print(f"| {name} | " + " | ".join(f"{r:.1f}" for r in rates) + " |")
    pool.release()


if __name__ == "__main__":
    main()
