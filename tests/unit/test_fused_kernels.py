"""Our Triton kernels (ulysses_train/levers/fused_kernels.py) against transformers' own functions, forward and backward.
Without a GPU, Triton's interpreter runs them on CPU tensors (conftest sets TRITON_INTERPRET=1): fp32 is checked
tightly; in bf16 the interpreter rounds its downcasts differently from the GPU (it truncated 490 of 1000 random
values that PyTorch rounds to nearest), so bf16 is checked to a few bf16 steps here and tightly in
tests/gpu/test_gpu.py."""

import inspect

import pytest
import torch

from tests.models import any_tiny_config
from ulysses_train.levers.fused_check import self_check
from ulysses_train.levers.fused_kernels import (
    GatedMulFunction,
    RotaryFunction,
    gated_rms_norm,
    kernels_run_on,
    rms_norm,
    triton_importable,
)
from ulysses_train.levers.lean_norm import LLAMA, T5, ZERO_CENTRED
from ulysses_train.levers.policy import LeverRequest, Levers
from ulysses_train.model.surgery import (
    check_fused_kernels,
    install_fused_gated_norms,
    install_fused_mlp,
    install_fused_rotary,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernels_run_on(DEVICE), reason="needs Triton (pip install triton); on CPU its "
                                                                   "interpreter (TRITON_INTERPRET=1, see conftest)")
# (relative tolerance of outputs and gradients) per dtype: fp32 arithmetic; bf16 within a couple of its 2^-8 steps
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.5e-2 if DEVICE.type == "cpu" else 6e-3}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


NORMS = {"llama": ("qwen3", "Qwen3RMSNorm", LLAMA), "t5": ("olmo3", "Olmo3RMSNorm", T5),
         "zero-centred": ("gemma3", "Gemma3RMSNorm", ZERO_CENTRED)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 7, 64), (2, 150, 8, 16), (3, 5, 80)],
                         ids=["hidden-rows", "head-rows-many-programs", "non-power-of-two"])
@pytest.mark.parametrize("rule", sorted(NORMS))
def test_rms_norm_matches_transformers(rule, shape, dtype):
    """Against transformers' RMSNorm module of each arithmetic (Qwen3's, OLMo 3's, Gemma 3's) evaluated in fp64
    (Llama's; the other two upcast to fp32 inside), with a gradient for input and weight. The second shape has 2400
    rows of 16: 38 row blocks, so several backward programs each sum a share of the weight's gradient."""
    import importlib

    family, name, norm_rule = NORMS[rule]
    cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    norm = cls(shape[-1], eps=1e-6).double()
    base = 0.0 if norm_rule.offset else 1.0  # a zero-centred weight of 0 scales by 1
    norm.weight.data = base + 0.2 * torch.randn(shape[-1], generator=g, dtype=torch.float64)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    ref_x = x.double().requires_grad_()
    ref = norm(ref_x)
    ref.backward(dy)

    got_x = x.to(DEVICE).requires_grad_()
    weight = norm.weight.detach().to(DEVICE, dtype).requires_grad_()
    got = rms_norm(got_x, weight, 1e-6, norm_rule)
    got.backward(dy.to(DEVICE, dtype))
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.isfinite(got).all()
    for what, a, b in (("out", got, ref), ("dx", got_x.grad, ref_x.grad), ("dw", weight.grad, norm.weight.grad)):
        assert rel_err(a.cpu(), b.double()) < TOL[dtype], what


def test_rms_norm_reads_rows_apart():
    """Qwen3.5's q norm gets q as a view between its gates (rows of 8 every 16 values): the kernel reads the rows
    where they are, forward and backward, as the PyTorch norm does (a kernel that took the rows as dense gave a loss
    6e-3 off on the tiny Qwen3.5)."""
    from ulysses_train.levers.lean_norm import _RMSNormFunction

    g = torch.Generator().manual_seed(5)
    both = torch.randn(2, 24, 4, 16, generator=g, dtype=torch.float64).to(DEVICE, torch.float32)
    w, dy = torch.randn(8, generator=g).to(DEVICE), torch.randn(2, 24, 4, 8, generator=g).to(DEVICE)
    results = []
    for norm in (rms_norm, _RMSNormFunction.apply):
        x, weight = both.clone().requires_grad_(), w.clone().requires_grad_()
        out = norm(x[..., :8], weight, 1e-6, ZERO_CENTRED)  # (2, 24, 4, 8), rows 16 apart
        out.backward(dy)
        results.append((out, x.grad, weight.grad))
    for what, a, b in zip(("out", "dx", "dw"), *results):
        assert rel_err(a.cpu(), b.cpu()) < 1e-5, what


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", ["model", "fp32"])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_gated_rms_norm_matches_transformers(family, weight_dtype, dtype):
    """The DeltaNet layers' gated norm (transformers' `RMSNormGated`: Llama's norm, times silu(gate) in fp32, in x's
    dtype) against the module itself in fp64, with the gradients of input, gate and weight; 2 x 150 x 8 rows of
    128 (the value heads as the mixer hands them over, 75 row blocks over several backward programs) and a gate read
    as a strided view (its rows apart, as a slice of the projection). The weight in the model's dtype rounds the
    norm's product as transformers does; an fp32 weight keeps it in fp32."""
    import importlib

    name = {"qwen3_5": "Qwen3_5RMSNormGated", "qwen3_next": "Qwen3NextRMSNormGated"}[family]
    cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    g = torch.Generator().manual_seed(5)
    shape = (2, 150, 8, 128)
    x = (3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    z_rows = (2 * torch.randn(2, 150, 8, 256, generator=g, dtype=torch.float64)).to(dtype)
    z = z_rows[..., 64:192]
    norm = cls(128, eps=1e-6).double()
    norm.weight.data = 1.0 + 0.2 * torch.randn(128, generator=g, dtype=torch.float64)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    ref_x, ref_z = x.double().requires_grad_(), z.double().requires_grad_()
    norm(ref_x, ref_z).backward(dy)

    w_dtype = dtype if weight_dtype == "model" else torch.float32
    w = norm.weight.detach().to(DEVICE, w_dtype).requires_grad_()
    # the gate sliced on the device: a copy to the GPU of a view with gaps would come out contiguous
    got_x, got_rows = x.to(DEVICE).requires_grad_(), z_rows.to(DEVICE).requires_grad_()
    got_z = got_rows[..., 64:192]
    assert got_z.stride(-2) == 256  # the gate's rows lie apart
    got = gated_rms_norm(got_x, got_z, w, 1e-6)
    got.backward(dy.to(DEVICE, dtype))
    dz = got_rows.grad[..., 64:192]
    assert got.dtype == dtype and dz.dtype == dtype and w.grad.dtype == w_dtype
    assert not got_rows.grad[..., :64].any() and not got_rows.grad[..., 192:].any()
    ref_out = norm(x.double(), z.double())
    for what, a, b in (("out", got, ref_out), ("dx", got_x.grad, ref_x.grad), ("dz", dz, ref_z.grad),
                       ("dweight", w.grad, norm.weight.grad)):
        assert rel_err(a.cpu(), b) < TOL[dtype], what


def test_gated_rms_norm_matches_the_module_in_its_own_dtype_bit_for_bit_in_fp32():
    """In fp32 the kernel gives the module's own forward bits up to fp32's last place (the same arithmetic: the
    module upcasts nothing there), so the patched model's forward is transformers'."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    g = torch.Generator().manual_seed(6)
    x, z = torch.randn(40, 128, generator=g), torch.randn(40, 128, generator=g)
    norm = Qwen3_5RMSNormGated(128, eps=1e-6)
    norm.weight.data = 1.0 + 0.2 * torch.randn(128, generator=g)
    torch.testing.assert_close(gated_rms_norm(x.to(DEVICE), z.to(DEVICE), norm.weight.to(DEVICE), 1e-6).cpu(),
                               norm(x, z), rtol=2e-6, atol=2e-6)


def test_only_the_gated_norms_computing_silu_are_patched():
    """The patch takes a module by what it computes with its own activation: Qwen3.5's gated norm with silu is
    replaced; the same class built with sigmoid (a family that gates so), Mamba 2's gated norm (the gate applied
    before the norm) and a plain RMSNorm are left alone."""
    from transformers.models.mamba2 import modeling_mamba2
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

    # Mamba 2's gated norm: `MambaRMSNormGated(hidden_size, eps)` in transformers 5.17, later
    # `Mamba2RMSNormGated(hidden_size, group_size, eps)`
    mamba_norm = next(getattr(modeling_mamba2, name) for name in ("Mamba2RMSNormGated", "MambaRMSNormGated")
                      if hasattr(modeling_mamba2, name))
    grouped = "group_size" in inspect.signature(mamba_norm).parameters
    silu, sigmoid = Qwen3_5RMSNormGated(16), Qwen3_5RMSNormGated(16)
    sigmoid.activation = "sigmoid"
    model = torch.nn.ModuleList([silu, sigmoid, mamba_norm(16, **({"group_size": 16} if grouped else {})),
                                 Qwen3_5RMSNorm(16)])
    assert install_fused_gated_norms(model) == 1
    assert type(silu).__name__ == "FusedQwen3_5RMSNormGated"
    assert [type(m).__name__ for m in model[1:]] == ["Qwen3_5RMSNormGated", mamba_norm.__name__, "Qwen3_5RMSNorm"]
    assert install_fused_gated_norms(model) == 0  # patching twice does nothing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["transposed-view", "contiguous", "cos-batch-1"])
def test_rotary_matches_transformers(layout, dtype):
    """Against transformers' apply_rotary_pos_emb in fp64, for q and k with fewer KV heads. The usual input is the
    (b, h, s, d) view of a (b, s, h, d) projection: the output keeps those strides, so the attention's transpose
    back is free."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(1)
    b, s, heads, kv_heads, d = 2, 9, 6, 2, 16
    if layout == "contiguous":
        q, k = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h in (heads, kv_heads))
    else:
        q, k = (torch.randn(b, s, h, d, generator=g, dtype=torch.float64).transpose(1, 2) for h in (heads, kv_heads))
    angles = torch.rand(1 if layout == "cos-batch-1" else b, s, d // 2, generator=g, dtype=torch.float64) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    dq, dk = torch.randn(q.shape, generator=g, dtype=torch.float64), torch.randn(k.shape, generator=g,
                                                                                 dtype=torch.float64)
    ref_q, ref_k = q.clone().requires_grad_(), k.clone().requires_grad_()
    out_q, out_k = apply_rotary_pos_emb(ref_q, ref_k, cos, sin)
    torch.autograd.backward((out_q, out_k), (dq, dk))

    got_q = q.to(DEVICE, dtype).requires_grad_()
    got_k = k.to(DEVICE, dtype).requires_grad_()
    c, n = cos.to(DEVICE, dtype), sin.to(DEVICE, dtype)
    rot_q, rot_k = RotaryFunction.apply(got_q, c, n), RotaryFunction.apply(got_k, c, n)
    torch.autograd.backward((rot_q, rot_k), (dq.to(DEVICE, dtype), dk.to(DEVICE, dtype)))
    assert rot_q.stride() == got_q.stride() and rot_k.stride() == got_k.stride()
    for name, a, want in (("q", rot_q, out_q), ("k", rot_k, out_k), ("dq", got_q.grad, ref_q.grad),
                          ("dk", got_k.grad, ref_k.grad)):
        assert rel_err(a.cpu(), want) < TOL[dtype], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act, hf_name", [("silu", "silu"), ("gelu_tanh", "gelu_pytorch_tanh")])
def test_gated_mul_matches_transformers(act, hf_name, dtype):
    """act(gate) * up as transformers' MLPs compute it (ACT2FN["silu"]: SwiGLU; ACT2FN["gelu_pytorch_tanh"]: Gemma's
    GeGLU), against fp64, with both gradients; 5000 values, so the last of three programs is partly masked."""
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(4)
    gate, up, dh = (3 * torch.randn(2, 50, 50, generator=g, dtype=torch.float64) for _ in range(3))
    ref_gate, ref_up = gate.to(dtype).double().requires_grad_(), up.to(dtype).double().requires_grad_()
    ref = ACT2FN[hf_name](ref_gate) * ref_up
    ref.backward(dh)
    got_gate, got_up = gate.to(DEVICE, dtype).requires_grad_(), up.to(DEVICE, dtype).requires_grad_()
    got = GatedMulFunction.apply(got_gate, got_up, act)
    got.backward(dh.to(DEVICE, dtype))
    for name, a, b in (("out", got, ref), ("dgate", got_gate.grad, ref_gate.grad), ("dup", got_up.grad, ref_up.grad)):
        assert a.dtype == dtype and rel_err(a.cpu(), b) < TOL[dtype], name


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "mistral", "qwen3_moe", "gemma3_text", "olmo3",
                                    "gpt_oss", "gemma4_text", "qwen3_5_text"])
@pytest.mark.slow
def test_fused_model_matches_transformers(family):
    """A whole tiny model of each family with our norms, rotary and gated MLP: every module test_surgery.py pins for
    the family is patched, loss and every gradient equal the unpatched model's (fp32), and the modeling file's own
    apply_rotary_pos_emb is never replaced (the patched attention forward reads ours through its own copy of the
    module globals). Gemma 3 runs the zero-centred norms and GELU, OLMo 3 and GPT-OSS the T5 ones."""
    import sys

    from transformers import AutoModelForCausalLM

    from tests.patch_counts import EXPECTED
    from ulysses_train.model.surgery import install_lean_norms

    config, want = any_tiny_config(family), EXPECTED[family]
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        attn = "eager" if family == "gpt_oss" else "sdpa"  # its sinks: transformers' SDPA path refuses them
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(DEVICE)
        if fused:
            assert install_lean_norms(model, fused=True) == want["RMSNorm"] > 0
            assert install_fused_rotary(model) == want["rotary"]
            assert install_fused_rotary(model) == 0  # patching twice does nothing
            assert install_fused_mlp(model) == want["gated MLP"] and install_fused_mlp(model) == 0
            assert install_fused_gated_norms(model) == want["gated RMSNorm"]
            modeling = sys.modules[type(model.model.layers[0]).__module__]
            original = getattr(modeling, "apply_rotary_pos_emb", None)
        loss = model(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE)).loss
        loss.backward()
        results.append((loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}))
    assert getattr(modeling, "apply_rotary_pos_emb", None) is original
    (base_loss, base_grads), (loss, grads) = results
    assert loss == pytest.approx(base_loss, rel=1e-6)
    assert grads.keys() == base_grads.keys()
    atol = 5e-6 if family == "gemma4_text" else 1e-6  # its embeddings' gradients reach 1e-2: fp32 rounding
    for name, ref in base_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")


def test_rotary_outside_the_standard_layout_falls_back():
    """Our apply_rotary_pos_emb hands a call its kernel does not cover (here unsqueeze_dim=2, the (b, s, h, d)
    convention) to transformers' own function."""
    from transformers.models.qwen3 import modeling_qwen3

    from ulysses_train.model.surgery import _fused_rotary

    original = modeling_qwen3.apply_rotary_pos_emb
    ours = _fused_rotary(original)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 5, 2, 8, generator=g), torch.randn(1, 5, 1, 8, generator=g)
    cos, sin = torch.randn(1, 5, 8, generator=g), torch.randn(1, 5, 8, generator=g)
    for got, want in zip(ours(q, k, cos, sin, unsqueeze_dim=2), original(q, k, cos, sin, unsqueeze_dim=2)):
        assert torch.equal(got, want)


def test_fused_kernels_flag(monkeypatch):
    """Where they cannot run, `on` is an error that names the flag and `auto` turns them off with the reason; where
    they can, the self-check passes and they stay on."""
    from ulysses_train.errors import ConfigError

    wanted = Levers(fused_kernels=True)
    assert check_fused_kernels(wanted, LeverRequest(fused_kernels="on"), DEVICE, torch.float32) == wanted
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="--fused_kernels on: they run on CUDA"):
        check_fused_kernels(wanted, LeverRequest(fused_kernels="on"), cpu, torch.float32)
    off = check_fused_kernels(wanted, LeverRequest(fused_kernels="auto"), cpu, torch.float32)
    assert not off.fused_kernels and off.why["fused_kernels"].startswith("auto: off, they run on CUDA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_check_passes_and_catches_a_wrong_kernel(dtype, monkeypatch):
    """Before a run uses the kernels, each runs forward and backward against the ops it replaces: here it passes,
    and a kernel made wrong on purpose (SwiGLU's output 10% too large) is named; `on` then stops with that reason
    and `auto` turns the kernels off with it."""
    from ulysses_train.errors import ConfigError
    from ulysses_train.levers import fused_check

    assert self_check(DEVICE, dtype) is None

    class TenPercentOff:
        @staticmethod
        def apply(gate, up, act="silu"):
            return GatedMulFunction.apply(gate, up * 1.1, act)
    monkeypatch.setattr(fused_check, "GatedMulFunction", TenPercentOff)
    problem = self_check(DEVICE, dtype)
    assert problem is not None and problem.startswith("silu_mul's output differs from PyTorch's by ")
    wanted = Levers(fused_kernels=True)
    with pytest.raises(ConfigError, match="--fused_kernels on: silu_mul"):
        check_fused_kernels(wanted, LeverRequest(fused_kernels="on"), DEVICE, dtype)
    off = check_fused_kernels(wanted, LeverRequest(fused_kernels="auto"), DEVICE, dtype)
    assert not off.fused_kernels and "silu_mul" in off.why["fused_kernels"]


def test_auto_falls_back_when_the_kernels_cannot_run():
    """A CUDA device where Triton is installed but the kernels fail (here: no CUDA at all in this torch): auto runs
    transformers' ops and says why; it never stops the run."""
    if torch.cuda.is_available() or not triton_importable():
        pytest.skip("needs a machine without CUDA, with Triton")
    off = check_fused_kernels(Levers(fused_kernels=True), LeverRequest(), torch.device("cuda"), torch.bfloat16)
    assert not off.fused_kernels and off.why["fused_kernels"].startswith("auto: off, ")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on CUDA the trainer runs bf16: tests/gpu/test_gpu.py compares it")
def test_trainer_with_fused_kernels_on_matches_off(tmp_path):
    """The real trainer (one process, fp32 on CPU, kernels interpreted) with `--fused_kernels on` against `off`:
    the log names what was patched, and each step's loss and gradient norm agree."""
    import sys

    from tests.trainer_runs import metrics, run

    runs = {}
    for mode in ("on", "off"):
        proc = run([sys.executable], ["--steps", "2", "--seq_len", "64", "--fused_kernels", mode], tmp_path / mode)
        runs[mode] = (proc.stdout + proc.stderr, metrics(tmp_path / mode))
    assert "fused kernels: 9 norms, 2 rotary, 2 gated MLP" in runs["on"][0]  # the tiny default: 2 layers
    assert "fused kernels: off" in runs["off"][0]
    for a, b in zip(runs["off"][1], runs["on"][1], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


ALL_FAMILIES = ["qwen3", "llama", "qwen2", "mistral", "qwen3_moe", "gemma2", "gemma3_text", "gemma4_text", "olmo3",
                "gpt_oss", "llama4_text", "smollm3", "qwen3_5_text", "qwen3_next"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_family_runs_the_fused_kernels_in_bf16(family):
    """Every supported family in bf16 with what `--fused_kernels auto` installs (norms, rotary, SwiGLU where they
    match) runs its attention on q, k and v of one dtype (OLMo 3's rotary returns q's dtype from fp32 cos/sin; a
    kernel that returned the promoted fp32 crashed SDPA and FA4 on the GPU), and its loss and gradients agree with
    the unpatched bf16 model's to bf16 rounding."""
    from transformers import AutoModelForCausalLM

    from tests.models import any_tiny_config
    from ulysses_train.model.surgery import install_lean_norms
    from ulysses_train.sp.attention import ATTN_NAME, register_ulysses_attention

    register_ulysses_attention(None, "sdpa")  # the trainer's attention, one rank
    config = any_tiny_config(family)
    ids = torch.randint(3, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(4))
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_NAME, dtype=torch.bfloat16)
        model = model.to(DEVICE).train()
        if fused:
            install_lean_norms(model, fused=True), install_fused_rotary(model), install_fused_mlp(model)
            install_fused_gated_norms(model)
        loss = model(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE)).loss
        loss.backward()
        grads = torch.cat([p.grad.float().flatten().cpu() for p in model.parameters() if p.grad is not None])
        results.append((loss.float().item(), grads))
    (base_loss, base_grads), (loss, grads) = results
    assert loss == pytest.approx(base_loss, rel=2e-2)
    # On the CPU Triton's interpreter truncates every bf16 downcast (module docstring), a bias that compounds over the
    # layers (and flips GPT-OSS's routing); test_fused_model_matches_transformers holds the arithmetic exact in fp32
    assert rel_err(grads, base_grads) < (5e-2 if DEVICE.type == "cuda" else 0.25)
