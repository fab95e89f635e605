"""Sliding windows, attention sinks and logit softcaps in each kernel path against plain attention (autograd through
the explicit scores, fp64 on the CPU), packed and not: SDPA's banded and sink paths (sp/patterns.py) and FA4's
registered ops with their plain-ops reference in place of the kernel (sp/fa4_op.py). Chunked attention's
documents, and the banded path's memory (no mask larger than a block and its window)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.references import pattern_attention
from ulysses_train.sp import fa4_op, kernels, patterns
from ulysses_train.sp.patterns import Pattern, chunk_documents

S, H, KV, D = 40, 4, 2, 8
SCALE = 0.3


CASES = [dict(window=6), dict(sinks=True), dict(window=6, sinks=True), dict(softcap=1.5),
         dict(softcap=1.5, window=6), dict(softcap=1.5, sinks=True, window=6)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "+".join(c))
@pytest.mark.parametrize("docs", [None, [15, 25]])
@pytest.mark.parametrize("kernel", ["sdpa", "flash_attn_4"])
def test_pattern_matches_plain_attention(case, docs, kernel, monkeypatch):
    monkeypatch.setattr(fa4_op, "IMPL", dict(fa4_op.REFERENCE_IMPL))  # FA4's op plumbing, exact kernels on CPU
    monkeypatch.setattr(patterns, "ROW_DOT_CHUNK_BYTES", 7 * H * D * 8)  # the sinks' row dots, 7 fp64 rows a chunk
    g = torch.Generator().manual_seed(len(case) + (docs is not None))
    q = torch.randn(1, H, S, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, KV, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(H, generator=g, dtype=torch.float64) if case.get("sinks") else None
    dout = torch.randn(1, S, H, D, generator=g, dtype=torch.float64)
    results = []
    for run in ("plain", "ours"):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks
                                                                   is not None else [])
        s = inputs[3] if sinks is not None else None
        if run == "plain":
            out = pattern_attention(*inputs[:3], docs or [S], case.get("window"), case.get("softcap"), s, SCALE)
        else:
            pattern = Pattern(case.get("window"), case.get("softcap"), s)
            out = kernels.KERNELS[kernel](*inputs[:3], SCALE, [docs] if docs else None, pattern)
        grads = torch.autograd.grad(out, inputs, dout)
        results.append((out, grads))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got_grads, want_grads):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


def test_the_band_never_builds_a_mask_wider_than_a_block_and_its_window(monkeypatch):
    shapes = []
    band = patterns._band_mask
    monkeypatch.setattr(patterns, "_band_mask", lambda q, k, w: shapes.append((len(q), len(k))) or band(q, k, w))
    q = torch.randn(1, 2, 2048, 8)
    patterns.patterned_sdpa(q, q, q, 0.3, None, Pattern(window=32), block=128)
    assert max(b for _, b in shapes) <= 128 + 32 and len(shapes) <= 3  # the interior blocks share one mask


def test_chunks_are_cut_from_each_documents_start():
    assert chunk_documents(None, 2, 20, 8) == [[8, 8, 4], [8, 8, 4]]
    assert chunk_documents([[5, 15]], 1, 20, 8) == [[5, 8, 7]]


class _AttentionOps(TorchDispatchMode):
    """Records the q, k, v shapes of every fused attention op and whether any plain matmul (the math fallback's
    scores) ran."""

    def __init__(self):
        super().__init__()
        self.fused, self.matmuls = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "scaled_dot_product" in name:
            self.fused.append([tuple(a.shape) for a in args[:4] if isinstance(a, torch.Tensor)])
        self.matmuls += name.startswith(("aten.bmm", "aten.mm", "aten.matmul"))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("window", [None, 16])
def test_sinks_reach_a_fused_kernel_with_head_dims_it_takes(window):
    """GPT-OSS's 64 + 1 head dims sent SDPA on CUDA to its math fallback, which held a full layer's fp32 scores
    (16 GiB at 8,192 tokens and 64 heads): the sink paths hand the fused kernels multiples of 8, a full layer's k and
    v with their KV heads as they are, and no score matmul runs outside them."""
    h, kv, s, d = 8, 2, 256, 64
    q = torch.randn(1, h, s, d, requires_grad=True)
    k, v = (torch.randn(1, kv, s, d, requires_grad=True) for _ in range(2))
    sinks = torch.randn(h, requires_grad=True)
    with _AttentionOps() as ops:
        kernels.KERNELS["sdpa"](q, k, v, d ** -0.5, None, Pattern(window=window, sinks=sinks)).sum().backward()
    assert ops.fused and ops.matmuls == 0, (ops.fused, ops.matmuls)
    assert all(shape[-1] % 8 == 0 for call in ops.fused for shape in call), ops.fused
    if window is None:
        assert ops.fused[0][1][1] == kv, ops.fused  # the forward's k: its KV heads, not copied


def test_the_sink_gradient_widens_a_chunk_of_rows_at_a_time(monkeypatch):
    """The sinks' gradient needs dout . out per row in fp32: widening a full layer's bf16 outputs at once held
    4 bytes x tokens x heads x head dim (2 GiB at 131k tokens and GPT-OSS's 64 heads of 64) in the backward."""
    h, kv, s, d = 4, 2, 64, 16
    monkeypatch.setattr(patterns, "ROW_DOT_CHUNK_BYTES", 8 * h * d * 4)
    q = torch.randn(1, h, s, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, kv, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sinks = torch.randn(h, requires_grad=True)
    out = kernels.KERNELS["sdpa"](q, k, v, d ** -0.5, None, Pattern(sinks=sinks))
    widened = []

    class _Widened(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor) and result.dtype == torch.float32 and result.dim() == 4:
                widened.append(result.numel())
            return result

    with _Widened():
        out.sum().backward()
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all()
    assert widened and max(widened) <= 8 * h * d, widened  # fp32 (b, rows, h, d) pieces of 8 rows, never the layer
