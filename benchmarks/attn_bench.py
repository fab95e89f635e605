"""Attention kernel benchmark on one GPU: the kernels `--attn_kernel` can pick, at Qwen3-4B's head geometry.

    python benchmarks/attn_bench.py --json OUT.json [--seq 65536 131072] [--heads 32 --kv_heads 8 --head_dim 128]
        [--layout bhsd|bshd] [--kernels ...]

For each sequence length and kernel it times the causal forward and forward+backward (CUDA events, median of
--reps after --warmup), on (b, h, s, d) tensors, contiguous or (`--layout bshd`) transposed views of (b, s, h, d) as
the trainer's attention passes them, and reports TFLOP/s by the FLOP model of docs/benchmarks.md (forward
2 x T^2 x heads x head_dim, backward 2.5x that) and the peak memory above the inputs. Kernels:

* `cudnn_expand`: SDPA forced to cuDNN, k and v repeated to every query head;
* `cudnn_gqa`: SDPA forced to cuDNN with `enable_gqa=True` (no k/v copies), if this PyTorch accepts it;
* `sdpa_gqa`: SDPA's own dispatch with `enable_gqa=True`, whichever backend that picks;
* `flash_attn_4`: FlashAttention-4 (`flash_attn.cute`), GQA native, if installed;
* `fa4_op`: our registered FA4 op (sp/fa4_op.py), what `--attn_kernel flash_attn_4` runs;
* `cudnn_fa4`: cuDNN's forward (its output and log-sum-exp) with FA4's backward, a pairing no caller of one library
  gets (both take (b, s, h, d) and a natural-log log-sum-exp).

Each kernel's output and gradients are first checked against `cudnn_expand` at a short length (relative error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import cuda_median_seconds  # noqa: E402


def cudnn_expand(q, k, v):
    rep = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def cudnn_gqa(q, k, v):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def sdpa_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def flash_attn_4(q, k, v):
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)


class _CudnnForwardFa4Backward(torch.autograd.Function):
    """cuDNN's forward with FA4's backward (`cudnn_fa4` in the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v):  # (b, h, s, d) as the other kernels take them; GQA native
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        from flash_attn.cute.interface import _flash_attn_bwd

        q, k, v, out, lse = ctx.saved_tensors
        b, h, s, _ = q.shape
        grads = _flash_attn_bwd(*(t.transpose(1, 2) for t in (q, k, v, out, dout.contiguous())),
                                lse.reshape(b, h, s), softmax_scale=q.shape[-1] ** -0.5, causal=True)
        return tuple(g.transpose(1, 2) for g in grads[:3])


def cudnn_fa4(q, k, v):
    return _CudnnForwardFa4Backward.apply(q, k, v)


def fa4_op(q, k, v):
    from ulysses_train.sp.fa4_op import fa4_attention

    return fa4_attention(*(t.transpose(1, 2) for t in (q, k, v)), q.shape[-1] ** -0.5).transpose(1, 2)


KERNELS = {"cudnn_expand": cudnn_expand, "cudnn_gqa": cudnn_gqa, "sdpa_gqa": sdpa_gqa, "flash_attn_4": flash_attn_4,
           "fa4_op": fa4_op, "cudnn_fa4": cudnn_fa4}


LAYOUT = "bhsd"  # --layout: how q, k, v and the upstream gradient lie in memory (every kernel takes (b, h, s, d))


def _tensor(heads, seq, head_dim, generator=None, grad=False):
    """(1, heads, seq, head_dim) bf16: contiguous, or a transposed view of (1, seq, heads, head_dim) under
    `--layout bshd`, as the trainer's attention hands them over (its q, k, v come off the projections so)."""
    shape = (1, seq, heads, head_dim) if LAYOUT == "bshd" else (1, heads, seq, head_dim)
    t = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator, requires_grad=grad)
    return t.transpose(1, 2) if LAYOUT == "bshd" else t


def inputs(seq, heads, kv_heads, head_dim, grad=True):
    g = torch.Generator(device="cuda").manual_seed(0)
    return tuple(_tensor(h, seq, head_dim, g, grad) for h in (heads, kv_heads, kv_heads))


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def check(fn, heads, kv_heads, head_dim, seq=4096) -> dict:
    """Output and gradients against cudnn_expand, same inputs and upstream gradient."""
    results = []
    for kernel in (cudnn_expand, fn):
        q, k, v = inputs(seq, heads, kv_heads, head_dim)
        out = kernel(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out) / out.numel() ** 0.5)))
    return {name: rel_err(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), results[1], results[0])}


def bench(fn, seq, heads, kv_heads, head_dim, reps, warmup) -> dict:
    q, k, v = inputs(seq, heads, kv_heads, head_dim)
    grad_out = _tensor(heads, seq, head_dim)
    with torch.no_grad():
        fwd = cuda_median_seconds(lambda: fn(q, k, v), reps, warmup)

    def fwd_bwd():
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad_out)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    both = cuda_median_seconds(fwd_bwd, reps, warmup)
    flops_fwd = 2 * seq**2 * heads * head_dim  # causal: half of 4 x T^2 x heads x head_dim
    return {"fwd_s": fwd, "fwd_bwd_s": both, "bwd_s": both - fwd,
            "fwd_tflops": flops_fwd / fwd / 1e12, "bwd_tflops": 2.5 * flops_fwd / max(both - fwd, 1e-9) / 1e12,
            "fwd_bwd_tflops": 3.5 * flops_fwd / both / 1e12,
            "extra_peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True)
    p.add_argument("--seq", type=int, nargs="+", default=[65536, 131072])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--kernels", nargs="+", default=list(KERNELS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                   help="bshd: q, k, v and the upstream gradient as transposed views of (b, s, h, d), the trainer's")
    a = p.parse_args()
    global LAYOUT
    LAYOUT = a.layout
    geometry = (a.heads, a.kv_heads, a.head_dim)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "geometry": geometry, "layout": a.layout, "results": {}}
    for name in a.kernels:
        fn = KERNELS[name]
        try:
            entry = {"check_vs_cudnn_expand": check(fn, *geometry)}
        except Exception as e:  # unsupported here (not installed, backend refuses GQA, ...): say so and go on
            out["results"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name:<14} unavailable: {out['results'][name]['error']}", flush=True)
            continue
        out["results"][name] = entry
        for seq in a.seq:
            entry[str(seq)] = r = bench(fn, seq, *geometry, a.reps, a.warmup)
            print(f"{name:<14} T={seq:>8} fwd {r['fwd_s']:.3f} s ({r['fwd_tflops']:.0f} TF/s)  "
                  f"bwd {r['bwd_s']:.3f} s ({r['bwd_tflops']:.0f})  fwd+bwd {r['fwd_bwd_s']:.3f} s "
                  f"({r['fwd_bwd_tflops']:.0f})  +{r['extra_peak_gib']:.1f} GiB  "
                  f"check {entry['check_vs_cudnn_expand']}", flush=True)
            with open(a.json, "w") as f:  # after every measurement: a run cut short leaves what it measured
                json.dump(out, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
