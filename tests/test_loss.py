"""The fused chunked loss equals the plain loss, values and gradients, including fully ignored chunks."""

import pytest
import torch

from ulysses_train.levers.loss import fused_linear_cross_entropy, plain_loss, sp_backward_scale
from ulysses_train.sp.sharding import IGNORE_INDEX


def _case(seed, n=50, hidden=24, vocab=70, ignore_rows=()):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.3
    y = torch.randint(0, vocab, (n,), generator=g)
    y[list(ignore_rows)] = IGNORE_INDEX
    return h, w, y


@pytest.mark.parametrize("chunk", [1, 7, 16, 50, 64])
@pytest.mark.parametrize("ignore_rows", [(), tuple(range(0, 16)), tuple(range(3, 50, 2)), tuple(range(50))])
def test_fused_matches_plain(chunk, ignore_rows):
    h, w, y = _case(chunk + len(ignore_rows), ignore_rows=ignore_rows)
    normalizer = torch.tensor(float(max(1, (y != IGNORE_INDEX).sum().item())), dtype=torch.float64)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = plain_loss(h1 @ w1.t(), y, normalizer)
    (ref * 1.7).backward()  # a non-unit upstream gradient must scale the precomputed gradients
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = fused_linear_cross_entropy(h2, w2, y, normalizer, chunk_size=chunk)
    (got * 1.7).backward()
    # float64: both compute the same sums, differently grouped
    torch.testing.assert_close(got, ref.to(got.dtype), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(got)
    if len(ignore_rows) == 50:
        assert got.item() == 0.0 and h2.grad.abs().max() == 0


def test_fused_bf16_close_to_fp32():
    h, w, y = _case(3, n=64, hidden=32, vocab=128)
    n = torch.tensor(64.0)
    ref = fused_linear_cross_entropy(h.float(), w.float(), y, n, 16)
    got = fused_linear_cross_entropy(h.bfloat16(), w.bfloat16(), y, n, 16)
    assert abs(got.item() - ref.item()) / ref.item() < 1e-2  # bf16 operands: ~3 significant digits


def test_backward_scale_follows_deepspeed_reduction_path():
    assert sp_backward_scale({"zero_optimization": {"stage": 3}}, 4) == 4
    assert sp_backward_scale({"zero_optimization": {"stage": 3, "reduce_scatter": False}}, 4) == 1
    assert sp_backward_scale({"zero_optimization": {"stage": 2}}, 4) == 1
