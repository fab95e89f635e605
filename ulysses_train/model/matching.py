"""Which transformers modules compute what our levers replace, decided by what they compute, not how they are spelt.

A lever replaces a module's forward only where the original computes exactly the function the replacement
computes: a probe runs the original (the class's own `forward` on stand-in weights, or the modeling file's own
function) and the reference formulas on the same small random input, and they must agree bit for bit in fp32. So a
transformers release that rewrites a norm without changing it still matches (and which of the norm arithmetics or
gated activations it computes is what the lever then runs), while a variant none of them covers (Gemma 4's
`pow(-0.5)` norm, GLM's interleaved rotary, an ungated MLP) does not, and keeps its own ops. The probes run on the CPU
on tiny tensors, once per forward (or function).

Why probes rather than transformers' extension point: transformers marks these layers for replacement through hub
kernels (`use_kernel_forward_from_hub("RMSNorm")`, `use_kernelized_func(apply_rotary_pos_emb)`), which needs the
`kernels` package and a layer repository laid out for it, and is a no-op stub without them. Our kernels are part of
this package and must also run on the CPU under Triton's interpreter in the tests.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import torch.nn.functional as F


def _probe_generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def rms_norm_rule(cls: type):
    """The lean_norm.NormRule whose arithmetic `cls.forward` computes (Llama's, T5's or zero-centred, checked bit for
    bit in fp32 and bf16 with the epsilon under either of transformers' names), or None."""
    return _norm_rule_of(cls, cls.forward)


def _norm_stand_in(cls: type, weight: torch.Tensor) -> torch.nn.Module:
    """An instance of `cls` without its __init__, holding `weight` and an epsilon under both of transformers' names,
    so a forward that calls its class's helpers (Gemma's `self._norm`) runs."""
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    module.weight, module.variance_epsilon, module.eps, module.with_scale = weight, 1e-6, 1e-6, True
    return module


@functools.lru_cache(maxsize=None)
def _norm_rule_of(cls: type, forward: Callable):
    from ..levers.lean_norm import RULES, reference_norm

    g = _probe_generator()
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(3, 5, 16, generator=g).to(dtype), torch.randn(16, generator=g).to(dtype)
        try:
            got = forward(_norm_stand_in(cls, w), x)
        except Exception:  # it needs more than a weight and an epsilon
            return None
        if not isinstance(got, torch.Tensor):
            return None
        cases.append((x, w, got))
    for rule in RULES:
        if all(got.dtype == (want := reference_norm(x, w, 1e-6, rule)).dtype and torch.equal(got, want)
               for x, w, got in cases):
            return rule
    return None


def computes_gated_norm(cls: type, activation: Optional[str]) -> bool:
    """Whether `cls.forward(x, gate)` computes lean_norm.reference_gated_norm (Qwen3.5's and Qwen3-Next's gated
    RMSNorm with silu), bit for bit in fp32 and bf16; `activation`: the instance's `activation` attribute, which
    the probe's stand-in carries (a class built with another activation computes another function)."""
    return _gated_norm_of(cls, cls.forward, activation)


@functools.lru_cache(maxsize=None)
def _gated_norm_of(cls: type, forward: Callable, activation: Optional[str]) -> bool:
    from ..levers.lean_norm import reference_gated_norm

    g = _probe_generator()
    for dtype in (torch.float32, torch.bfloat16):
        x, z, w = (torch.randn(*shape, generator=g).to(dtype) for shape in ((3, 5, 16), (3, 5, 16), (16,)))
        module = _norm_stand_in(cls, w)
        if activation is not None:
            module.activation = activation
        try:
            with torch.no_grad():
                got = forward(module, x, z)
        except Exception:  # it takes no gate, or needs more than a weight, an epsilon and an activation
            return False
        want = reference_gated_norm(x, z, w, 1e-6)
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or not torch.equal(got, want):
            return False
    return True


def gated_mlp_activation(cls: type, act: Optional[torch.nn.Module]) -> Optional[str]:
    """Which activation of fused_kernels.GATED_ACTIVATIONS `cls.forward`, with its activation module `act`, computes
    as down(act(gate(x)) * up(x)): "silu" (SwiGLU), "gelu_tanh" (Gemma's GeGLU), or None."""
    if act is None:
        return None
    key = (type(act), repr(act))  # activations of one type and repr compute the same function
    _ACTIVATIONS.setdefault(key, copy.deepcopy(act))
    return _mlp_activation_of(cls.forward, key)


_ACTIVATIONS: dict[tuple, torch.nn.Module] = {}
_GATED = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


@functools.lru_cache(maxsize=None)
def _mlp_activation_of(forward: Callable, act_key: tuple) -> Optional[str]:
    act = _ACTIVATIONS[act_key]
    g = _probe_generator()  # the probe's own generator: the run's random stream stays as --seed left it

    def linear(n_in: int, n_out: int) -> torch.nn.Linear:
        layer = torch.nn.Linear(n_in, n_out, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n_out, n_in, generator=g))
        return layer

    with torch.random.fork_rng(devices=[]):  # nn.Linear's own initialisation draws from the global generator
        gate, up, down = linear(8, 12), linear(8, 12), linear(12, 8)
    x = torch.randn(2, 3, 8, generator=g)
    try:
        with torch.no_grad():
            got = forward(SimpleNamespace(gate_proj=gate, up_proj=up, down_proj=down, act_fn=act), x)
    except Exception:
        return None
    if not isinstance(got, torch.Tensor):
        return None
    with torch.no_grad():
        return next((name for name, fn in _GATED.items() if torch.equal(got, down(fn(gate(x)) * up(x)))), None)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@functools.lru_cache(maxsize=None)
def computes_llama_rotary(fn: Callable) -> bool:
    """`fn(q, k, cos, sin)` is the Llama rotary embedding: x * cos + rotate_half(x) * sin, cos and sin (b, s, d)
    broadcast over the heads of q and k (b, h, s, d)."""
    g = _probe_generator()
    q, k = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 1, 3, 8, generator=g)
    angles = torch.rand(1, 3, 4, generator=g) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    try:
        got_q, got_k = fn(q, k, cos, sin)
    except Exception:
        return False
    want = [t * cos[:, None] + _rotate_half(t) * sin[:, None] for t in (q, k)]
    return torch.equal(got_q, want[0]) and torch.equal(got_k, want[1])


@functools.lru_cache(maxsize=None)
def rotary_keeps_input_dtype(fn: Callable) -> bool:
    """Whether `fn(q, k, cos, sin)` returns q and k in their own dtype when cos and sin are fp32 (OLMo 3's rotary
    embedding hands out fp32 cos and sin and casts its result back to q's dtype), rather than in the promoted dtype
    (Llama's, whose cos and sin come in the activations' dtype)."""
    g = _probe_generator()
    q, k = torch.randn(1, 2, 3, 8, generator=g).bfloat16(), torch.randn(1, 1, 3, 8, generator=g).bfloat16()
    angles = torch.rand(1, 3, 8, generator=g)
    got_q, got_k = fn(q, k, angles.cos(), angles.sin())
    return got_q.dtype == q.dtype and got_k.dtype == k.dtype


def uses_global(fn: Callable, name: str) -> bool:
    """The innermost function under `fn`'s decorators reads the module global `name`."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return code is not None and name in code.co_names


def rebind_global(fn: Callable, name: str, value) -> Optional[Callable]:
    """A copy of `fn` that reads the module global `name` as `value`, the module itself untouched; decorators made
    with functools.wraps around it are copied around the copy. The copy sees the module's other globals as they are
    now (a snapshot: the modeling files bind them at import). None when `fn` is not a plain function or a decorator
    holds its function some other way than in its closure."""
    if not isinstance(fn, types.FunctionType):
        return None
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        new = types.FunctionType(fn.__code__, {**fn.__globals__, name: value}, fn.__name__, fn.__defaults__,
                                 fn.__closure__)
    else:
        cells = fn.__closure__ or ()
        holds = [i for i, c in enumerate(cells) if _cell_value(c) is inner]
        new_inner = rebind_global(inner, name, value)
        if not holds or new_inner is None:
            return None
        closure = tuple(types.CellType(new_inner) if i in holds else c for i, c in enumerate(cells))
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    functools.update_wrapper(new, fn)
    new.__kwdefaults__ = fn.__kwdefaults__
    if inner is not None:
        new.__wrapped__ = new_inner
    return new


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
