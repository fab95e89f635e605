"""The ring's kernel overhead on one GPU: causal attention cut into a zigzag ring of R ranks, all in one process,
against one call of the same kernel over the whole sequence.

    python benchmarks/ring_bench.py --json /tmp/ring_bench.json [--seq 131072] [--rings 2 4] [--kernels ...]

Every rank of the ring is run in turn in this process (its chunks and the K/V blocks are there already, so neither
the split nor any communication is timed): each one's kernel calls on each block (ulysses_train/sp/ring.py:
`step_tiles`), the log-sum-exp merge of their outputs, and in the backward the kernel's backward on each block from the
merged output, with dq, dk and dv summed. What this measures is what the ring adds to the attention kernel itself: more,
smaller calls and the merges.
The goal (issue: hybrid Ulysses x ring) is at most 5% at R=2 and 10% at R=4 at 131k tokens.

Head shape of Qwen3-4B by default (32 query heads, 8 KV heads, head_dim 128, bf16), forward+backward, each kernel
that runs here: `flash_attn_4` (FA4, if importable), `sdpa` (cuDNN), `flash_attn` (FA2, if installed). Before timing,
each kernel's ring output and gradients are compared with its own full call at --check_seq tokens (relative error in
the table). The table is printed last; --json (or $OUT/ring_bench.json) gets the details.

On the CPU (`--device cpu`, tiny sizes) the same code runs with ATen's CPU flash attention:
tests/distributed/test_ring.py uses `ring_in_one_process` to check the ring's arithmetic against one call."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_train.sp.block_kernels import BlockKernel, block_kernel  # noqa: E402
from ulysses_train.sp.ring import ring_backward, ring_forward  # noqa: E402
from ulysses_train.sp.sharding import block_positions  # noqa: E402


class SummedGradients:
    """Stands in for the ring's gradient exchange in one process: each block's dk, dv shares summed by owner."""

    def __init__(self):
        self.by_owner: dict[int, tuple] = {}

    def add(self, src: int, dk, dv) -> None:
        if src in self.by_owner:
            self.by_owner[src][0].add_(dk)
            self.by_owner[src][1].add_(dv)
        else:
            self.by_owner[src] = (dk, dv)


def split_ranks(x: torch.Tensor, ring_size: int) -> list[torch.Tensor]:
    """(b, s, ...) -> each ring rank's pair of zigzag chunks, (b, s / ring, ...) each."""
    chunk = x.shape[1] // (2 * ring_size)
    return [x[:, block_positions(i, ring_size, chunk).to(x.device)] for i in range(ring_size)]


def join_ranks(parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of split_ranks."""
    ring_size, chunk = len(parts), parts[0].shape[1] // 2
    out = parts[0].new_empty((parts[0].shape[0], 2 * ring_size * chunk, *parts[0].shape[2:]))
    for i, part in enumerate(parts):
        out[:, block_positions(i, ring_size, chunk).to(out.device)] = part
    return out


def run_ranks(qs, ks, vs, scale: float, kernel: BlockKernel, doc_ids=None, douts=None):
    """Every rank of the ring in turn, on inputs already split (split_ranks): what the benchmark times. Returns
    each rank's out, and with `douts` also each rank's dq and each block's (dk, dv), cast back to the inputs' dtype
    as the ring's op does."""
    ring_size = len(qs)

    def blocks(me):
        return (((me - step) % ring_size, ks[(me - step) % ring_size], vs[(me - step) % ring_size])
                for step in range(ring_size))

    results = [ring_forward(qs[me], blocks(me), me, ring_size, scale, kernel, doc_ids) for me in range(ring_size)]
    if douts is None:
        return [out for out, _ in results]
    grads = SummedGradients()
    dqs = [ring_backward(douts[me], qs[me], *results[me], blocks(me), grads, me, ring_size, scale, kernel,
                         doc_ids).to(qs[me].dtype) for me in range(ring_size)]
    dkvs = [(dk.to(ks[i].dtype), dv.to(vs[i].dtype)) for i, (dk, dv) in sorted(grads.by_owner.items())]
    return [out for out, _ in results], dqs, dkvs


def ring_in_one_process(q, k, v, ring_size: int, scale: float, kernel: BlockKernel,
                        doc_ids: Optional[torch.Tensor] = None, dout: Optional[torch.Tensor] = None):
    """Causal attention of q (b, s, h, d), k/v (b, s, hkv, d) computed as a zigzag ring of `ring_size` ranks, each
    run in turn -> out (b, s, h, d) in sequence order, and with `dout` also (dq, dk, dv)."""
    qs, ks, vs = (split_ranks(t, ring_size) for t in (q, k, v))
    if dout is None:
        return join_ranks(run_ranks(qs, ks, vs, scale, kernel, doc_ids))
    outs, dqs, dkvs = run_ranks(qs, ks, vs, scale, kernel, doc_ids, split_ranks(dout, ring_size))
    return join_ranks(outs), (join_ranks(dqs), join_ranks([dk for dk, _ in dkvs]), join_ranks([dv for _, dv in dkvs]))


def full_call(q, k, v, scale: float, kernel: BlockKernel, dout=None):
    """One causal call over the whole sequence, forward and (with `dout`) backward."""
    out, lse = kernel.forward(q, k, v, scale, True)
    if dout is None:
        return out
    return out, tuple(kernel.backward(dout, q, k, v, out, lse, scale, True))


# ---------------------------------------------------------------- the measurement


def available_kernels(device: torch.device) -> list[str]:
    from ulysses_train.sp.kernels import kernel_available

    if device.type != "cuda":
        return ["sdpa"]
    names = ["flash_attn_4"] if kernel_available("flash_attn_4") else []
    names.append("sdpa")
    return names + (["flash_attn"] if kernel_available("flash_attn") else [])


def inputs(seq: int, heads: int, kv_heads: int, head_dim: int, dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, dout = (torch.randn(1, seq, h, head_dim, generator=g, device=device, dtype=dtype)
                     for h in (heads, kv_heads, kv_heads, heads))
    return q, k, v, dout


def relative_error(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def check(kernel: BlockKernel, ring: int, seq: int, shape: tuple, dtype, device) -> float:
    """The largest relative error of out, dq, dk, dv of the ring against the full call."""
    q, k, v, dout = inputs(seq, *shape, dtype, device, seed=1)
    scale = shape[2] ** -0.5
    out, grads = ring_in_one_process(q, k, v, ring, scale, kernel, dout=dout)
    ref_out, ref_grads = full_call(q, k, v, scale, kernel, dout)
    return max(relative_error(a, b) for a, b in zip((out, *grads), (ref_out, *ref_grads)))


def seconds(fn, device: torch.device, warmup: int, reps: int) -> float:
    """Median wall seconds of fn() (synchronised on CUDA)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(kernel_name: str, seq: int, rings: list[int], shape: tuple, dtype, device, warmup: int, reps: int,
            check_seq: int) -> list[dict]:
    kernel = block_kernel(kernel_name, device, dtype)
    q, k, v, dout = inputs(seq, *shape, dtype, device)
    scale = shape[2] ** -0.5
    full = seconds(lambda: full_call(q, k, v, scale, kernel, dout), device, warmup, reps)
    rows = [{"kernel": kernel_name, "seq": seq, "ring": 1, "seconds": full, "overhead": 0.0, "rel_error": 0.0}]
    for ring in rings:
        qs, ks, vs, douts = (split_ranks(x, ring) for x in (q, k, v, dout))  # what each rank holds: not timed
        t = seconds(lambda: run_ranks(qs, ks, vs, scale, kernel, douts=douts), device, warmup, reps)
        rows.append({"kernel": kernel_name, "seq": seq, "ring": ring, "seconds": t, "overhead": t / full - 1,
                     "rel_error": check(kernel, ring, check_seq, shape, dtype, device)})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'kernel':<14}{'tokens':>9}{'R':>4}{'fwd+bwd s':>11}{'overhead':>10}{'rel err':>10}"]
    for r in rows:
        lines.append(f"{r['kernel']:<14}{r['seq']:>9}{r['ring']:>4}{r['seconds']:>11.4f}{r['overhead']:>9.1%}"
                     f"{r['rel_error']:>10.1e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[131072])
    p.add_argument("--rings", type=int, nargs="+", default=[2, 4])
    p.add_argument("--kernels", nargs="+", default=None, help="default: every one that runs here")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--check_seq", type=int, default=8192, help="tokens of the correctness check")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device, dtype = torch.device(a.device), {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    shape = (a.heads, a.kv_heads, a.head_dim)
    rows = []
    for name in a.kernels or available_kernels(device):
        for seq in a.seq:
            try:
                rows += measure(name, seq, a.rings, shape, dtype, device, a.warmup, a.reps, a.check_seq)
            except Exception as e:  # one kernel failing must not hide the others' numbers
                rows.append({"kernel": name, "seq": seq, "error": f"{type(e).__name__}: {e}"})
                print(f"{name} at {seq}: {rows[-1]['error']}", file=sys.stderr)
    path = a.json or (os.path.join(os.environ["OUT"], "ring_bench.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__, "shape": shape, "dtype": a.dtype, "rows": rows}, f, indent=1)
    print(table([r for r in rows if "error" not in r]))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
