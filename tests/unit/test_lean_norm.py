"""--lean_norm: the lean RMSNorm computes transformers' forward bit for bit and its gradients within rounding,
keeps 4 bytes less per element for the backward in a bf16 model, and leaves other norms alone."""

import pytest
import torch

from tests.models import tiny_config
from ulysses_train.model.surgery import install_lean_norms


def _norm_pair(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    reference = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(64) * 0.5 + 1)
    lean = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    lean.load_state_dict(reference.state_dict())
    assert install_lean_norms(lean) == 1
    return reference, lean


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_forward_is_bitwise_and_gradients_match(dtype, tol):
    reference, lean = _norm_pair(dtype)
    x = (torch.randn(3, 17, 64) * 3).to(dtype)
    grad = torch.randn(3, 17, 64).to(dtype)
    results = []
    for norm in (reference, lean):
        xi = x.clone().requires_grad_()
        out = norm(xi)
        out.backward(grad)
        results.append((out, xi.grad, norm.weight.grad))
    (out_r, gx_r, gw_r), (out_l, gx_l, gw_l) = results
    assert torch.equal(out_r, out_l)  # the same ops in the same order
    torch.testing.assert_close(gx_l.double(), gx_r.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(gw_l.double(), gw_r.double(), rtol=tol, atol=tol * 10)


def test_saves_four_bytes_less_per_element_in_bf16():
    reference, lean = _norm_pair(torch.bfloat16)
    x = torch.randn(1, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = {}
    for name, norm in (("reference", reference), ("lean", lean)):
        sizes = {}

        def pack(t, sizes=sizes):
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            norm(x)
        saved[name] = sum(size for ptr, size in sizes.items() if ptr != norm.weight.untyped_storage().data_ptr())
    elements = x.numel()
    assert saved["lean"] == elements * 2 + 1024 * 4  # the bf16 input (shared with the caller) and the fp32 rstd
    assert saved["reference"] - saved["lean"] >= elements * 4  # the fp32 copy of the input is gone


def test_swaps_the_norms_of_each_rule_and_leaves_the_others():
    """Llama's norms (Qwen3) and Gemma's zero-centred ones are swapped, each computing its own arithmetic bit for bit
    in the forward (bf16); a norm of an arithmetic no rule has is left alone."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3"))
    layers = model.config.num_hidden_layers
    assert install_lean_norms(model) == 4 * layers + 1  # input, post-attention, q and k per layer, and the final one
    assert install_lean_norms(model) == 0  # idempotent
    gemma = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gemma", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16))
    assert install_lean_norms(gemma) == 3  # (1 + weight) x in fp32: the zero-centred rule
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    reference, lean = GemmaRMSNorm(32).bfloat16(), GemmaRMSNorm(32).bfloat16()
    with torch.no_grad():
        reference.weight.normal_(generator=torch.Generator().manual_seed(1))
    lean.load_state_dict(reference.state_dict())
    assert install_lean_norms(lean) == 1 and torch.equal(lean(x), reference(x))

    class TwicePlusOne(GemmaRMSNorm):
        def forward(self, x):
            return (self._norm(x.float()) * (2.0 + self.weight.float())).type_as(x)
    assert install_lean_norms(TwicePlusOne(32)) == 0
