"""Our kernels against Liger-Kernel's and eager PyTorch, forward+backward, at Qwen3-4B's shapes (one GPU).

    python benchmarks/kernel_bench.py --tokens 65536 131072 --json kernels_ours_liger_eager.json
    python benchmarks/kernel_bench.py --dry        # CPU: tiny shapes through Triton's interpreter, a wiring check

Each op, each implementation: the CUDA-event median of --repeats forward+backward calls after one warm-up (and of
forward calls without autograd, in the JSON), every call on fresh inputs made before its timer starts (Liger's SwiGLU
backward writes its gradients into its inputs, its RMSNorm backward into the output's gradient, and its rotary turns q
and k in place); the peak memory above those inputs during the call (the inputs' gradients included); and the largest
absolute difference of the outputs and every gradient from ours, on the same inputs.

| op | eager | ours | Liger |
|---|---|---|---|
| loss | transformers' way: bf16 logits, upcast, cross-entropy | fused_linear_cross_entropy, 4,096-row chunks |
  liger_linear_cross_entropy as the trainer calls it (fp32 head-gradient sum); also with Liger's default bf16 sum |
| RMSNorm | Qwen3RMSNorm.forward | rms_norm (lean, fused) | LigerRMSNormFunction (llama casting) |
| SwiGLU | silu(gate) * up | SiLUMulFunction | LigerSiLUMulFunction |
| rotary | apply_rotary_pos_emb on q and k | RotaryFunction on q, then k | LigerRopeFunction on q and k |

The norms and the rotary take the (b, h, s, d) views of the projections' (b, s, h, d) outputs, as in the model.
The table is printed last; --json writes every number with the device and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from dataclasses import dataclass
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GiB = 2**30


@dataclass(frozen=True)
class Shapes:
    hidden: int = 2560
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 9728
    vocab: int = 151936
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def tiny(cls) -> "Shapes":
        """fp32: Triton's interpreter gets some of Liger's bf16 kernels wrong (NaN from its rotary) or fails them."""
        return cls(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=200, dtype=torch.float32)


@dataclass
class Case:
    """One op: `make()` gives fresh leaf inputs (dict) and the upstream gradients; each implementation maps the
    inputs to its outputs (a tuple)."""

    op: str
    make: Callable[[], tuple[dict, tuple]]
    impls: dict  # name -> fn(inputs) -> tuple of outputs


def _randn(*shape, s: Shapes, dev: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=dev, dtype=torch.float32) * scale).to(s.dtype)


def loss_case(t: int, s: Shapes, dev: str) -> Case:
    from ulysses_train.levers.loss import fused_linear_cross_entropy, liger_linear_cross_entropy, plain_loss

    def make():
        hidden = _randn(t, s.hidden, s=s, dev=dev).requires_grad_()
        weight = _randn(s.vocab, s.hidden, s=s, dev=dev, scale=0.02).requires_grad_()
        labels = torch.randint(0, s.vocab, (t,), device=dev)
        labels[: t // 8] = -100  # a prompt's worth of ignored labels
        return {"hidden": hidden, "weight": weight, "labels": labels}, (torch.ones((), device=dev),)

    def count(x):
        return (x["labels"] != -100).sum().float()

    def liger_bf16_sum(x):  # Liger's own default: the head's gradient summed over its chunks in bf16
        from ulysses_train.levers.loss import _liger_loss

        loss = _liger_loss()(x["hidden"], x["weight"], x["labels"], ignore_index=-100, reduction="sum")
        return (loss / count(x),)

    return Case("loss", make, {
        "eager": lambda x: (plain_loss(x["hidden"] @ x["weight"].t(), x["labels"], count(x)),),
        "ours": lambda x: (fused_linear_cross_entropy(x["hidden"], x["weight"], x["labels"], count(x), 4096),),
        "liger": lambda x: (liger_linear_cross_entropy(x["hidden"], x["weight"], x["labels"], count(x)),),
        "liger_bf16_dw": liger_bf16_sum})


def norm_case(op: str, t: int, heads: int, width: int, s: Shapes, dev: str) -> Case:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from ulysses_train.levers.fused_kernels import rms_norm

    def make():
        shape = (1, t, width) if heads == 0 else (1, t, heads, width)
        x = _randn(*shape, s=s, dev=dev).requires_grad_()
        w = (1 + 0.1 * torch.randn(width, device=dev)).to(s.dtype).requires_grad_()
        return {"x": x, "w": w}, (_randn(*shape, s=s, dev=dev),)

    def liger(x):
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        return (LigerRMSNormFunction.apply(x["x"], x["w"], 1e-6, 0.0, "llama"),)

    def eager(x):
        module = types.SimpleNamespace(weight=x["w"], variance_epsilon=1e-6)  # transformers' forward, our weight
        return (Qwen3RMSNorm.forward(module, x["x"]),)

    return Case(op, make, {"eager": eager, "ours": lambda x: (rms_norm(x["x"], x["w"], 1e-6),), "liger": liger})


def swiglu_case(t: int, s: Shapes, dev: str) -> Case:
    from ulysses_train.levers.fused_kernels import SiLUMulFunction

    def make():
        gate, up = (_randn(1, t, s.intermediate, s=s, dev=dev).requires_grad_() for _ in range(2))
        return {"gate": gate, "up": up}, (_randn(1, t, s.intermediate, s=s, dev=dev),)

    def liger(x):
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return (LigerSiLUMulFunction.apply(x["gate"], x["up"]),)

    return Case("swiglu", make, {"eager": lambda x: (torch.nn.functional.silu(x["gate"]) * x["up"],),
                                 "ours": lambda x: (SiLUMulFunction.apply(x["gate"], x["up"]),), "liger": liger})


def rotary_case(t: int, s: Shapes, dev: str) -> Case:
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from ulysses_train.levers.fused_kernels import RotaryFunction

    angles = torch.rand(1, t, s.head_dim // 2, device=dev) * t
    cos, sin = (f(torch.cat([angles, angles], -1)).to(s.dtype) for f in (torch.cos, torch.sin))

    def make():
        # the (b, h, s, d) views of the projections' (b, s, h, d) outputs, leaves of their own
        q, k = (_randn(1, t, h, s.head_dim, s=s, dev=dev).transpose(1, 2).requires_grad_()
                for h in (s.heads, s.kv_heads))
        return {"q": q, "k": k}, tuple(_randn(1, h, t, s.head_dim, s=s, dev=dev) for h in (s.heads, s.kv_heads))

    def liger(x):
        from liger_kernel.ops.rope import LigerRopeFunction

        return LigerRopeFunction.apply(x["q"], x["k"], cos, sin)

    return Case("rotary q+k", make, {
        "eager": lambda x: apply_rotary_pos_emb(x["q"], x["k"], cos, sin),
        "ours": lambda x: (RotaryFunction.apply(x["q"], cos, sin), RotaryFunction.apply(x["k"], cos, sin)),
        "liger": liger})


def cases(t: int, s: Shapes, dev: str) -> list[Case]:
    return [loss_case(t, s, dev), norm_case("rmsnorm hidden rows", t, 0, s.hidden, s, dev),
            norm_case("rmsnorm q heads", t, s.heads, s.head_dim, s, dev),
            norm_case("rmsnorm k heads", t, s.kv_heads, s.head_dim, s, dev), swiglu_case(t, s, dev),
            rotary_case(t, s, dev)]


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def run_once(case: Case, fn, dev: str, backward: bool = True) -> tuple[float, float, list]:
    """One forward+backward (or forward alone, without autograd) on fresh inputs: (seconds, peak GiB above the
    inputs, [outputs..., gradients...])."""
    inputs, grads = case.make()
    _sync(dev)
    base = torch.cuda.memory_allocated() if dev == "cuda" else 0
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    with torch.set_grad_enabled(backward):
        outputs = fn(inputs)
    if backward:
        torch.autograd.backward(outputs, grads)
    if dev == "cuda":
        end.record()
        torch.cuda.synchronize()
        seconds, peak = start.elapsed_time(end) / 1e3, (torch.cuda.max_memory_allocated() - base) / GiB
    else:
        seconds, peak = time.perf_counter() - began, 0.0
    leaves = [v for v in inputs.values() if v.requires_grad and backward]
    return seconds, peak, [o.detach() for o in outputs] + [v.grad for v in leaves]


def measure(case: Case, repeats: int, dev: str) -> dict:
    """{implementation: {"ms" (forward+backward), "peak_gib", "fwd_ms" (forward alone), "max_abs_diff_vs_ours"}
    or {"error"}} for one case."""
    out, reference = {}, None
    for name in ("ours", *[n for n in case.impls if n != "ours"]):
        error = None
        try:
            torch.manual_seed(0)  # every implementation's first call sees the same inputs
            _, _, tensors = run_once(case, case.impls[name], dev)
            runs = [run_once(case, case.impls[name], dev)[:2] for _ in range(repeats)]
            forward = [run_once(case, case.impls[name], dev, backward=False)[0] for _ in range(repeats + 1)][1:]
        except torch.OutOfMemoryError:
            error = "out of memory"
        except Exception as e:  # one implementation failing leaves the others measured
            error = f"{type(e).__name__}: {str(e).strip()[:200]}"
        if error:  # out of the except block, so its frames (and their tensors) are gone
            out[name] = {"error": error}
            if dev == "cuda":
                torch.cuda.empty_cache()
            continue
        if name == "ours":
            reference = tensors
        diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(tensors, reference)]
        out[name] = {"ms": 1e3 * statistics.median(r[0] for r in runs), "peak_gib": max(r[1] for r in runs),
                     "fwd_ms": 1e3 * statistics.median(forward), "max_abs_diff_vs_ours": diffs}
        del tensors
        if dev == "cuda":
            torch.cuda.empty_cache()
    return out


def _cell(result: dict) -> str:
    if "error" in result:
        return result["error"]
    return f"{result['ms']:.2f} ms, {result['peak_gib']:.2f} GiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", "--seq", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=os.path.join(os.environ["OUT"], "kernels.json") if "OUT" in os.environ
                        else None)
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU through Triton's interpreter "
                                                           "(checks the wiring, not the speed)")
    args = parser.parse_args()
    if args.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
        dev, shapes, tokens, repeats = "cpu", Shapes.tiny(), [64], 2
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --dry)")
        dev, shapes, tokens, repeats = "cuda", Shapes(), args.tokens, args.repeats
    rows = []
    for t in tokens:
        for case in cases(t, shapes, dev):
            rows.append({"tokens": t, "op": case.op, **measure(case, repeats, dev)})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401  (its version, below)

        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
                       "torch": torch.__version__, "triton": version("triton"), "liger_kernel": version("liger-kernel"),
                       "repeats": repeats, "rows": rows}, f, indent=1)
    print(f"\n{'tokens':>8} {'op':<20} {'eager':>22} {'ours':>22} {'liger':>22} {'liger, bf16 dW sum':>22}  "
          f"liger - ours, max abs (outputs, gradients)")
    for r in rows:
        liger = r["liger"]
        diffs = ", ".join(f"{d:.1e}" for d in liger.get("max_abs_diff_vs_ours", []))
        extra = _cell(r["liger_bf16_dw"]) if "liger_bf16_dw" in r else ""
        print(f"{r['tokens']:>8} {r['op']:<20} {_cell(r['eager']):>22} {_cell(r['ours']):>22} {_cell(liger):>22} "
              f"{extra:>22}  {diffs}")


if __name__ == "__main__":
    main()
