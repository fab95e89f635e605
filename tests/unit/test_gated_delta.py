"""The gated delta rule as a registered op (sp/gated_delta_op.py), on the CPU with its exact reference standing in for
FLA's kernels: the op's autograd wiring gives transformers' torch rule, packed and not; under checkpointing with
`keep_linear` each Gated DeltaNet layer runs the rule once, not twice, the loss and gradients unchanged, and the kept
outputs go to the host with the offload. tests/gpu/test_gpu_deltanet.py runs FLA's kernels through the same op."""

import inspect

import pytest
import torch

from tests.model_runs import checkpointed_loss
from tests.models import LINEAR, use_reference_deltanet_kernels

SEQ = 48


@pytest.fixture
def reference_kernels(monkeypatch):
    """The op's kernels are the exact reference; the mixers run the conv of their modeling file (FLA's is CUDA's)."""
    return use_reference_deltanet_kernels(monkeypatch)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 7, 30, SEQ]])
def test_the_op_gives_the_torch_rule_and_its_gradients(reference_kernels, cu_seqlens):
    """q and k normalised before the op, two value heads per key head, fp64: output and every input's gradient equal
    those of transformers' rule with `use_qk_l2norm_in_kernel=True` run on each document alone, to fp32 rounding (the
    torch rule computes in fp32, normalising inside). A backward that hands a gradient to the wrong input (g and beta
    have one shape) is off by order one."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, SEQ, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, SEQ, 4, 8, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, SEQ, 4, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, SEQ, 4, generator=gen, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (q, k, v, g, beta)]
    grad_out = torch.randn(1, SEQ, 4, 8, generator=gen, dtype=torch.float64)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    out = reference_kernels.gated_delta_rule(*inputs, cu_seqlens=cu)
    got = [out, *torch.autograd.grad(out, inputs, grad_out)]
    bounds = cu_seqlens or [0, SEQ]
    want_out = torch.cat([rule(q[:, a:b].repeat_interleave(2, 2), k[:, a:b].repeat_interleave(2, 2), v[:, a:b],
                               g=g[:, a:b], beta=beta[:, a:b], initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=True)[0] for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    want = [want_out, *torch.autograd.grad(want_out, inputs, grad_out)]
    for name, a, b in zip(["out", "dq", "dk", "dv", "dg", "dbeta"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _deltanet_step(keep_linear: bool, checkpoint: bool, offload: bool = False):
    """Loss and gradients of a tiny Qwen3.5 (3 DeltaNet layers, 1 attention layer) through our mixers with the
    `fla` kernel (the reference standing in), and how many times the rule's forward ran."""
    from ulysses_train.sp import gated_delta_op

    calls = []
    forward = gated_delta_op.IMPL["forward"]
    gated_delta_op.IMPL["forward"] = lambda *args: calls.append(1) or forward(*args)
    checkpointing = dict(keep_linear=keep_linear) if checkpoint else None
    model, loss, hooks = checkpointed_loss("qwen3_5_text", SEQ, offload, checkpointing)
    loss.backward()
    gated_delta_op.IMPL["forward"] = forward
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads, len(calls), hooks.host_bytes if hooks else 0


def test_kept_deltanet_outputs_skip_the_rule_in_the_recompute_and_change_nothing(reference_kernels):
    base_loss, base_grads, base_calls, _ = _deltanet_step(False, checkpoint=False)
    _, _, recomputed_calls, _ = _deltanet_step(False, checkpoint=True)
    loss, grads, calls, _ = _deltanet_step(True, checkpoint=True)
    layers = 3
    assert (base_calls, recomputed_calls, calls) == (layers, 2 * layers, layers)
    assert loss == pytest.approx(base_loss, rel=1e-6)
    for name, ref in base_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_the_offload_moves_the_kept_deltanet_outputs_to_the_host(reference_kernels):
    """With the offload, each DeltaNet layer's kept output, decay sum and A block go to the host with the layer
    inputs: the host holds exactly their bytes more than without keeping them, and the gradients are unchanged."""
    _, base_grads, _, inputs_only = _deltanet_step(False, checkpoint=True, offload=True)
    _, grads, calls, with_kept = _deltanet_step(True, checkpoint=True, offload=True)
    c = LINEAR["qwen3_5_text"]
    heads, value = c["linear_num_value_heads"], c["linear_value_head_dim"]
    per_layer = SEQ * (heads * value * 4 + heads * 4 + heads * 64 * 4)  # fp32 model: out, decay sum, A
    assert calls == 3 and with_kept - inputs_only == 3 * per_layer
    for name, ref in base_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
