"""Which kernel runs the gated delta rule of the Gated DeltaNet layers (`--linear_kernel`), chosen once per run.

- `fla`: flash-linear-attention's chunked kernels (Triton; `pip install -e ".[fla]"`), through our registered op
  (gated_delta_op.py: the same calls as FLA's `chunk_gated_delta_rule`, and checkpointing can keep its outputs), and
  FLA's causal depthwise convolution (`fla.modules.causal_conv1d`) for the conv before it. Both take packed documents
  as `cu_seqlens`. On CUDA only. On Hopper GPUs with Triton from 3.4 up to (not including) 3.7.1, FLA's gated
  backward (`chunk_bwd_dqkwg`) is wrong unless `tilelang` is installed, which FLA then uses for it; FLA refuses that
  backward itself, at the first step.
- `torch`: transformers' reference implementation in the layer's own modeling file (`torch_chunk_gated_delta_rule`),
  exact, on any device, and more than ten times slower on a GPU.
- `auto`: `fla` where it runs and agrees with `torch` in a self-check at start-up (forward and gradients on a small
  packed batch), else `torch`, the reason in the log (as `--loss_kernel auto` does for Liger-Kernel).

Why we choose instead of transformers: transformers binds FLA at import whenever `fla` imports, on any device, and
learns about Hopper's Triton only when a backward raises. Why FLA's conv rather than the modeling file's: without the
`causal-conv1d` package (or the hub kernel transformers fetches for it) the modeling file runs a depthwise
`F.conv1d`, whose CUDA backward is slow at long sequences, and which needs zeros inserted between packed documents
(deltanet.py); FLA's restarts at `cu_seqlens` itself. The mixers (deltanet.py) call the kernels chosen here.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..errors import ConfigError

LINEAR_KERNELS = ("auto", "fla", "torch")
SELF_CHECK_LIMIT = 2e-2  # relative, bf16 inputs: a kernel that miscompiles is off by order one
FLA_CONV_ACTIVATIONS = ("silu", "swish", None)  # what FLA's causal conv applies after itself


def fla_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
             cu_seqlens=None):
    """transformers' `chunk_gated_delta_rule` signature over our op (gated_delta_op.py), for what the mixers ask:
    no state in or out, q and k L2-normalised in the rule."""
    from .gated_delta_op import gated_delta_rule

    if initial_state is not None or output_final_state or not use_qk_l2norm_in_kernel:
        raise NotImplementedError("the DeltaNet mixers train from a zero state with the L2-normalised rule")
    return gated_delta_rule(q, k, v, g, beta, cu_seqlens), None


def fla_conv(x, weight, bias, activation, cu_seqlens=None):
    """FLA's causal depthwise conv: x (b, s, C), weight (C, K) -> (b, s, C), restarting at `cu_seqlens` (b = 1)."""
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens)[0]


@dataclass(frozen=True)
class LinearKernel:
    name: str  # "fla" or "torch"
    why: str = ""  # under auto: why this one

    def rule(self, module) -> Callable:
        """The gated delta rule for `module` (a DeltaNet mixer), with the signature of transformers' rule: FLA's
        through our op, or its modeling file's torch function (unwrapped from transformers' kernel dispatch, which
        would hand it FLA's when `fla` imports)."""
        if self.name == "fla":
            return fla_rule
        return inspect.unwrap(sys.modules[type(module).__module__].torch_chunk_gated_delta_rule)

    def conv(self, activation: Optional[str]) -> Optional[Callable]:
        """FLA's causal depthwise conv `(x (b, s, C), weight (C, K), bias, activation, cu_seqlens) -> (b, s, C)`
        where it runs this layer's activation, else None (the mixer runs its modeling file's)."""
        if self.name != "fla" or activation not in FLA_CONV_ACTIVATIONS:
            return None
        return fla_conv

    @property
    def grouped_values(self) -> bool:
        """Whether the rule takes fewer key heads than value heads itself (FLA's does; transformers' torch rule
        does only in some versions, so the mixer repeats the key heads for it)."""
        return self.name == "fla"

    @property
    def takes_documents(self) -> bool:
        """Whether one call restarts at `cu_seqlens` (else the mixer calls it document by document)."""
        return self.name == "fla"


def fla_problem(device: torch.device) -> Optional[str]:
    """Why FLA cannot run the gated delta rule here (None: it can)."""
    if device.type != "cuda":
        return f"FLA's kernels run on CUDA, not on {device.type}"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as e:  # noqa: BLE001 - an install that does not import is as absent
        return f"flash-linear-attention does not import ({type(e).__name__}: {e}); pip install -e \".[fla]\""
    import triton

    version = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3])
    hopper = torch.cuda.get_device_capability(device)[0] == 9
    if hopper and (3, 4, 0) <= version < (3, 7, 1):
        try:
            import tilelang  # noqa: F401
        except Exception:  # noqa: BLE001
            return (f"FLA's gated backward is wrong on Hopper with Triton {triton.__version__} unless tilelang is "
                    f"installed: pip install tilelang (or Triton >= 3.7.1)")
    return None


def self_check(device: torch.device, torch_rule: Callable) -> Optional[str]:
    """FLA's rule against the torch rule, and FLA's conv against F.conv1d, on a small packed batch, bf16, forward and
    gradients; None when they agree."""
    with torch.enable_grad():
        return _compare(device, torch_rule) or _compare_conv(device)


def _relative_errors(names, ours, refs) -> Optional[str]:
    for name, a, b in zip(names, ours, refs):
        error = ((a.float() - b.float()).norm() / b.float().norm()).item()
        if not error <= SELF_CHECK_LIMIT:
            return f"FLA's {name} is {error:.1e} off the torch reference (limit {SELF_CHECK_LIMIT:.0e})"
    return None


def _compare_conv(device: torch.device) -> Optional[str]:
    """FLA's causal conv with SiLU over packed documents against a depthwise F.conv1d on each document alone."""
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(1)
    docs, channels, width = [100, 28, 128], 64, 4
    x = torch.randn(1, sum(docs), channels, generator=g, device=device).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(channels, width, generator=g, device=device).to(torch.bfloat16).requires_grad_()
    bounds = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], device=device)
    grad_out = torch.randn(1, sum(docs), channels, generator=g, device=device).to(torch.bfloat16)
    ours = fla_conv(x, weight, None, "silu", bounds)
    ref = torch.cat([F.silu(F.conv1d(x[:, a:b].float().transpose(1, 2), weight.float()[:, None], padding=width - 1,
                                     groups=channels)[..., :b - a]).transpose(1, 2)
                     for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())], dim=1)
    return _relative_errors(["conv output", "conv dx", "conv dweight"],
                            [ours, *torch.autograd.grad(ours, (x, weight), grad_out)],
                            [ref, *torch.autograd.grad(ref, (x, weight), grad_out.float())])


def _compare(device: torch.device, torch_rule: Callable) -> Optional[str]:
    g = torch.Generator(device=device).manual_seed(0)
    nk, nv, d, docs = 2, 4, 64, [100, 28, 128]
    length = sum(docs)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device)

    inputs = [rand(1, length, nk, d), rand(1, length, nk, d), rand(1, length, nv, d),
              -torch.rand(1, length, nv, generator=g, device=device), torch.rand(1, length, nv, generator=g,
                                                                                device=device)]
    # as the mixer passes them: q, k, v and beta in the model's dtype, the decay g in fp32
    inputs = [x.to(torch.bfloat16).requires_grad_() for x in inputs[:3]] + [
        inputs[3].requires_grad_(), inputs[4].to(torch.bfloat16).requires_grad_()]
    bounds = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], device=device)
    options = dict(initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    grad_out = rand(1, length, nv, d).to(torch.bfloat16)
    fla_out = fla_rule(*inputs[:3], g=inputs[3], beta=inputs[4], cu_seqlens=bounds, **options)[0]
    fla_grads = torch.autograd.grad(fla_out, inputs, grad_out)
    q, k = (x.repeat_interleave(nv // nk, dim=2) for x in inputs[:2])  # the torch rule's heads, as the mixer's
    ref_out = torch.cat([torch_rule(*(x[:, a:b].float() for x in (q, k, inputs[2])), g=inputs[3][:, a:b],
                                    beta=inputs[4][:, a:b].float(), **options)[0]
                         for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())], dim=1)
    ref_grads = torch.autograd.grad(ref_out, inputs, grad_out.float())
    return _relative_errors(["output", "dq", "dk", "dv", "dg", "dbeta"], [fla_out, *fla_grads],
                            [ref_out, *ref_grads])


def choose_linear_kernel(request: str, device: torch.device, torch_rule: Callable) -> LinearKernel:
    """--linear_kernel resolved on this device: `fla` asked for and impossible is a ConfigError naming the flag."""
    if request not in LINEAR_KERNELS:
        raise ConfigError(f"--linear_kernel {request}: choose one of {', '.join(LINEAR_KERNELS)}")
    if request == "torch":
        return LinearKernel("torch")
    problem = fla_problem(device)
    if problem is None:
        try:
            problem = self_check(device, torch_rule)
        except Exception as e:  # noqa: BLE001 - a kernel that fails to run is a reason, not a crash
            problem = f"FLA's self-check raised {type(e).__name__}: {str(e)[:300]}"
    if problem is None:
        return LinearKernel("fla", "auto: FLA agrees with the torch rule" if request == "auto" else "")
    if request == "fla":
        raise ConfigError(f"--linear_kernel fla: {problem}; use --linear_kernel auto or torch")
    return LinearKernel("torch", f"auto: torch, FLA is not used: {problem}")
