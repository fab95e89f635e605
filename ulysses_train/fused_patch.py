"""Installs our fused kernels (fused_kernels.py) into a transformers model, and decides whether they run
(`--fused_kernels`): each patch matches transformers' Llama code byte code for byte code, so other variants (GLM's
interleaved rotary, Gemma's 1 + weight norm, non-SiLU MLPs) keep their own ops. Before a run turns them on, a
self-check compares each kernel on this device with the PyTorch ops it replaces: `auto` falls back to those ops,
with the reason in the log, if a kernel fails to compile or disagrees."""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Optional

import torch

from .fused_kernels import RotaryFunction, SiLUMulFunction, kernels_run_on, rms_norm, rotary_fits, triton_importable


def code_key(fn) -> tuple | None:
    """What makes two functions the same code (byte code, names, constants other than docstrings), so that a
    modeling file's copy of a Llama function matches it; None for objects without Python code."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return None
    return code.co_code, code.co_names, tuple(c for c in code.co_consts if not isinstance(c, str))


def _standard_rotary_module(module_globals: dict) -> bool:
    """The modeling file's apply_rotary_pos_emb and rotate_half are transformers' Llama ones (Qwen2/3, Qwen3-MoE,
    Mistral, ... copy them); interleaved or partial rotary variants (GLM, Cohere, Phi) are not."""
    from transformers.models.llama import modeling_llama as llama

    return all(name in module_globals and code_key(module_globals[name]) == code_key(getattr(llama, name))
               for name in ("apply_rotary_pos_emb", "rotate_half"))


def _with_fused_rotary(forward, module_globals: dict):
    """The attention forward, with the modeling file's apply_rotary_pos_emb swapped for ours while it runs, so that
    only this model's attention modules use it (the swap also covers the recomputed forward of a checkpoint)."""
    original = module_globals["apply_rotary_pos_emb"]

    def fused_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not rotary_fits(q, k, cos, sin, unsqueeze_dim):
            return original(q, k, cos, sin, unsqueeze_dim)
        return RotaryFunction.apply(q, cos, sin), RotaryFunction.apply(k, cos, sin)

    @functools.wraps(forward)
    def attention_forward(*args, **kwargs):
        module_globals["apply_rotary_pos_emb"] = fused_apply_rotary_pos_emb
        try:
            return forward(*args, **kwargs)
        finally:
            module_globals["apply_rotary_pos_emb"] = original
    return attention_forward


def install_fused_rotary(model: torch.nn.Module) -> int:
    """Routes the rotary embedding of every attention module whose modeling file uses the standard Llama rotary
    through RotaryFunction; returns how many modules were patched."""
    patched = 0
    for module in model.modules():
        module_globals = getattr(sys.modules.get(type(module).__module__), "__dict__", {})
        key = code_key(type(module).forward)
        if key is None or "apply_rotary_pos_emb" not in key[1]:  # key[1]: the names the forward uses
            continue
        if getattr(module, "_fused_rotary", False) or not _standard_rotary_module(module_globals):
            continue
        module.forward = _with_fused_rotary(module.forward, module_globals)
        module._fused_rotary = True
        patched += 1
    return patched


def _fused_mlp_forward(self, x):
    return self.down_proj(SiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


_FUSED_MLP_CLASSES: dict[type, type] = {}


def install_fused_mlp(model: torch.nn.Module) -> int:
    """Swaps the class of every dense SwiGLU MLP whose forward is transformers' Llama one with SiLU (Qwen2/3,
    Mistral, Qwen3-MoE's dense layers) for one that runs silu(gate) * up as SiLUMulFunction; returns how many.
    Composes with --tiled_mlp, whose tiles call the class's forward."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    reference, patched = code_key(LlamaMLP.forward), 0
    for module in model.modules():
        cls = type(module)
        if cls in _FUSED_MLP_CLASSES.values() or code_key(cls.forward) != reference:
            continue
        if type(getattr(module, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
            continue
        if cls not in _FUSED_MLP_CLASSES:
            _FUSED_MLP_CLASSES[cls] = type(f"Fused{cls.__name__}", (cls,), {"forward": _fused_mlp_forward})
        module.__class__ = _FUSED_MLP_CLASSES[cls]
        patched += 1
    return patched


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _check_cases(device: torch.device, dtype: torch.dtype):
    """(name, fused op, the PyTorch ops it replaces, leaves) on small random inputs that cover the kernels' edges:
    two row blocks of a norm, strided q with fewer rows than heads x dims, a partly masked SwiGLU block."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from .lean_norm import _RMSNormFunction

    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()

    x, w, q, gate, up = leaf(3, 40, 96), leaf(96), leaf(2, 24, 4, 16), leaf(3, 700), leaf(3, 700)
    angles = torch.rand(1, 24, 8, generator=g) * 24
    cos, sin = (f(torch.cat([angles, angles], -1)).to(device, dtype) for f in (torch.cos, torch.sin))
    return [("rms_norm", lambda: rms_norm(x, w, 1e-6), lambda: _RMSNormFunction.apply(x, w, 1e-6), (x, w)),
            ("rotary", lambda: RotaryFunction.apply(q.transpose(1, 2), cos, sin),
             lambda: apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)[0], (q,)),
            ("silu_mul", lambda: SiLUMulFunction.apply(gate, up), lambda: torch.nn.functional.silu(gate) * up,
             (gate, up))]


def self_check(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Runs each kernel forward and backward on `device` and compares it with the PyTorch ops it replaces; returns
    what failed or disagreed, None when all agree (to 1e-4 in fp32; to 3e-2 in bf16, a few of its 2^-8 steps)."""
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    try:
        for name, fused, reference, leaves in _check_cases(device, dtype):
            got, want = fused(), reference()
            grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
            pairs = zip((got, *torch.autograd.grad(got, leaves, grad)),
                        (want, *torch.autograd.grad(want, leaves, grad)))
            for what, (a, b) in zip(("output", *(f"gradient {i}" for i in range(len(leaves)))), pairs):
                err = _rel_err(a, b)
                if not err <= tol:  # NaN fails too
                    return f"{name}'s {what} differs from PyTorch's by {err:.1e} (tolerance {tol:.0e})"
    except Exception as e:  # a kernel that does not compile or launch here
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    return None


def resolve_fused_kernels(mode: str, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """--fused_kernels: whether our kernels run, and a line for the log. auto = on for CUDA devices with Triton
    installed, if the self-check passes (else transformers' ops, the reason logged); on = required, and a failed
    self-check is an error (on the CPU it needs Triton's interpreter, which the tests use); off = transformers'
    ops (with --lean_norm's RMSNorm)."""
    from .config import ConfigError

    if mode == "off":
        return False, "off"
    runnable = kernels_run_on(device) if mode == "on" else device.type == "cuda" and triton_importable()
    if not runnable:
        if mode == "auto":
            return False, "off"
        why = "Triton is not installed (pip install triton)" if not triton_importable() else \
            f"they run on CUDA devices (or on the CPU under TRITON_INTERPRET=1, slowly), and this run is on " \
            f"{device.type}"
        raise ConfigError(f"--fused_kernels on: {why}; use --fused_kernels auto or off")
    problem = self_check(device, dtype)
    if problem is None:
        return True, "on"
    if mode == "on":
        raise ConfigError(f"--fused_kernels on: the self-check failed: {problem}; use --fused_kernels off")
    return False, f"off (auto: the self-check failed: {problem})"
