"""Fused chunked loss benchmark on one GPU: time and peak memory against the chunk size (`--loss_chunk_size`).

    python benchmarks/loss_bench.py --json OUT.json [--tokens 65536 131072] [--chunks 1024 2048 4096 8192 16384]

For each length and chunk size it runs `fused_linear_cross_entropy` (the trainer's loss: LM head + cross-entropy,
both gradients taken in the forward) on bf16 hidden states and a Qwen3-4B-sized head (vocab 151936 x hidden 2560),
forward and backward, and reports the median seconds of --reps after one warm-up, the head's TFLOP/s (3 matmuls of
2 x tokens x vocab x hidden each) and the peak memory above the inputs. The default chunk size is the one this
picks on the H200 (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.timing import cuda_median_seconds  # noqa: E402
from ulysses_train.levers.loss import fused_linear_cross_entropy  # noqa: E402


def run_once(hidden, weight, labels, chunk):
    hidden.grad = weight.grad = None
    loss = fused_linear_cross_entropy(hidden, weight, labels, torch.tensor(float(labels.numel()), device="cuda"),
                                      chunk)
    loss.backward()
    return loss


def measure(tokens: int, chunk: int, vocab: int, hidden_size: int, reps: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    run_once(hidden, weight, labels, chunk)  # warm-up (cuBLAS heuristics, allocator)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seconds = cuda_median_seconds(lambda: run_once(hidden, weight, labels, chunk), reps, warmup=0)
    return {"tokens": tokens, "chunk": chunk, "seconds": seconds,
            "head_tflops": 3 * 2 * tokens * vocab * hidden_size / seconds / 1e12,
            "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    rows = []
    print(f"{'tokens':>8}{'chunk':>7}{'s':>8}{'TFLOP/s':>9}{'peak extra GiB':>16}", flush=True)
    for tokens in args.tokens:
        for chunk in args.chunks:
            row = measure(tokens, chunk, args.vocab, args.hidden, args.reps)
            rows.append(row)
            print(f"{tokens:8d}{chunk:7d}{row['seconds']:8.3f}{row['head_tflops']:9.0f}{row['peak_extra_gib']:16.2f}",
                  flush=True)
            torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
