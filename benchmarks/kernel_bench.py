"""Our fused Triton kernels against the PyTorch ops they replace, at Qwen3-4B's shapes (one GPU).

For each of the per-layer norm and rotary calls, forward and forward+backward times (CUDA events, median of
--repeats after a warm-up) of transformers' ops (rotary) or our lean RMSNorm in PyTorch ops, and of our kernels,
with the bytes each must move at least and the bandwidth that gives. Per layer, Qwen3 runs 2 hidden-wide norms,
a q and a k norm, the rotary on q and k, and the SwiGLU product; a checkpointed step runs each forward twice.

    python benchmarks/kernel_bench.py --seq 65536 131072 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import cuda_median_seconds  # noqa: E402
from ulysses_train.levers.fused_kernels import RotaryFunction, SiLUMulFunction, rms_norm  # noqa: E402
from ulysses_train.levers.lean_norm import _RMSNormFunction  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 2560, 32, 8, 128, 9728


def _fwd_bwd(op, inputs, grad):
    def run():
        for t in inputs:
            t.grad = None
        op().backward(grad)
    return run


def cases(seq: int, dev: str = "cuda"):
    """(name, eager op, fused op, leaf inputs, output shape, minimum bytes forward, minimum bytes fwd+bwd)."""
    bf16 = torch.bfloat16
    out = []
    for name, shape in (("norm hidden", (seq, HIDDEN)), ("norm q", (seq, HEADS, HEAD_DIM)),
                        ("norm k", (seq, KV_HEADS, HEAD_DIM))):
        x = torch.randn(1, *shape, device=dev, dtype=bf16, requires_grad=True)
        w = torch.randn(shape[-1], device=dev, dtype=bf16, requires_grad=True)
        size = x.numel() * 2
        out.append((name, lambda x=x, w=w: _RMSNormFunction.apply(x, w, 1e-6), lambda x=x, w=w: rms_norm(x, w, 1e-6),
                    [x, w], x.shape, 2 * size, 5 * size))  # fwd: x in, y out; bwd: x, dy in, dx out
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    angles = torch.rand(1, seq, HEAD_DIM // 2, device=dev) * seq
    cos, sin = (f(torch.cat([angles, angles], -1)).to(bf16) for f in (torch.cos, torch.sin))
    for name, heads in (("rotary q", HEADS), ("rotary k", KV_HEADS)):
        x = torch.randn(1, seq, heads, HEAD_DIM, device=dev, dtype=bf16).transpose(1, 2).requires_grad_()
        size = x.numel() * 2
        out.append((name, lambda x=x: apply_rotary_pos_emb(x, x, cos, sin)[0],
                    lambda x=x: RotaryFunction.apply(x, cos, sin), [x], x.shape, 2 * size, 4 * size))
    gate, up = (torch.randn(1, seq, INTERMEDIATE, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))
    size = gate.numel() * 2
    out.append(("swiglu", lambda: torch.nn.functional.silu(gate) * up, lambda: SiLUMulFunction.apply(gate, up),
                [gate, up], gate.shape, 3 * size, 8 * size))  # fwd: 2 in, 1 out; bwd: 3 in, 2 out
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for seq in args.seq:
        for name, eager, fused, inputs, shape, fwd_bytes, both_bytes in cases(seq):
            grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(fused(), eager(), rtol=2e-2, atol=2e-2)
            row = {"seq": seq, "op": name}
            for kind, op in (("eager", eager), ("fused", fused)):
                with torch.no_grad():
                    row[f"{kind}_fwd_s"] = cuda_median_seconds(op, args.repeats)
                row[f"{kind}_fwd_bwd_s"] = cuda_median_seconds(_fwd_bwd(op, inputs, grad), args.repeats)
            row["fused_fwd_tb_s"] = fwd_bytes / row["fused_fwd_s"] / 1e12
            row["fused_fwd_bwd_tb_s"] = both_bytes / row["fused_fwd_bwd_s"] / 1e12
            rows.append(row)
            torch.cuda.empty_cache()
    print(f"{'seq':>7} {'op':<12} {'eager fwd':>10} {'fused fwd':>10} {'eager f+b':>10} {'fused f+b':>10} "
          f"{'TB/s f+b':>8}")
    for r in rows:
        print(f"{r['seq']:>7} {r['op']:<12} {r['eager_fwd_s'] * 1e3:>8.2f}ms {r['fused_fwd_s'] * 1e3:>8.2f}ms "
              f"{r['eager_fwd_bwd_s'] * 1e3:>8.2f}ms {r['fused_fwd_bwd_s'] * 1e3:>8.2f}ms "
              f"{r['fused_fwd_bwd_tb_s']:>8.2f}")
    # per step: 36 layers x (forward + recomputed forward + backward); norms: 2 hidden + q + k; rotary: q + k
    per_layer = {k: sum(r[f"{k}_fwd_s"] + r[f"{k}_fwd_bwd_s"] for r in rows if r["seq"] == args.seq[0])
                 for k in ("eager", "fused")}
    hidden = [r for r in rows if r["seq"] == args.seq[0] and r["op"] == "norm hidden"][0]
    for k in per_layer:  # the hidden-wide norm runs twice per layer
        per_layer[k] += hidden[f"{k}_fwd_s"] + hidden[f"{k}_fwd_bwd_s"]
    print(f"per step at {args.seq[0]} tokens, 36 layers: eager {36 * per_layer['eager']:.2f} s, "
          f"fused {36 * per_layer['fused']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "per_step_s": {k: 36 * v for k, v in per_layer.items()},
                       "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
