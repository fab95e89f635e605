"""--verify's comparisons: fp64 sums over gradients a piece at a time (verify.squared_sums) are the sums of the whole
tensors, whatever the pieces' size, for a bf16 gradient against an fp32 or fp64 reference."""

import pytest
import torch

from ulysses_train.train.verify import verify


@pytest.mark.parametrize("piece", [7, 64, 1 << 26])  # pieces that split a tensor unevenly, evenly, not at all
@pytest.mark.parametrize("ref_dtype", [torch.float32, torch.float64])
def test_squared_sums_by_pieces_are_the_whole_tensors(monkeypatch, piece, ref_dtype):
    monkeypatch.setattr(verify, "PIECE", piece)
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 3, 17, generator=gen, dtype=ref_dtype)
    ours = (ref + 1e-3 * torch.randn(ref.shape, generator=gen, dtype=ref_dtype)).bfloat16()
    cpu = torch.device("cpu")
    whole = [t.pow(2).sum().item() for t in (ours.double(), ref.double(), ours.double() - ref.double())]
    assert whole[2] > 0 and verify.squared_sums(ours, ref, cpu) == pytest.approx(whole, rel=1e-12)
    grads, refs = {"a": ours, "b": ours[:2] * 2}, {"a": ref, "b": ref[:2] * 2}
    errors = verify.relative_errors(2.0, grads, 2.5, refs, cpu)
    whole = (sum((grads[n].double() - refs[n].double()).pow(2).sum() for n in refs) /
             sum(refs[n].double().pow(2).sum() for n in refs)).sqrt().item()
    norms = [sum(g[n].double().pow(2).sum() for n in refs).sqrt().item() for g in (grads, refs)]
    assert errors.loss == pytest.approx(0.2) and errors.tensors == 2
    assert errors.grad_whole == pytest.approx(whole, rel=1e-12)
    assert [errors.norm, errors.reference_norm] == pytest.approx(norms, rel=1e-12)
    assert errors.grad_norm == pytest.approx(abs(norms[0] - norms[1]) / norms[1], rel=1e-9)
    assert verify.grad_norm(refs, cpu) == pytest.approx(norms[1], rel=1e-12)


@pytest.mark.gpu
def test_the_sums_on_the_gpu_are_the_hosts(monkeypatch):
    """Where --verify compares on a GPU: the same sums as on the host, pieces crossing the tensor's rows."""
    monkeypatch.setattr(verify, "PIECE", 1000)
    gen = torch.Generator().manual_seed(1)
    ref = torch.randn(300, 77, generator=gen)
    ours = (ref * 1.01).bfloat16()
    on_gpu, on_host = (verify.squared_sums(ours, ref, torch.device(d)) for d in ("cuda", "cpu"))
    assert on_gpu == pytest.approx(on_host, rel=1e-12)
