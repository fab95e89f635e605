"""The local attention kernels that run inside the Ulysses all-to-all, and the choice among them (`--attn_kernel`).

Each takes q (b, hq, s, d), k/v (b, hkv, s, d) for the full sequence and returns (b, s, hq, d), causal. `docs`, when
packing, gives per batch row the lengths of its documents (summing to s): attention is causal inside each document
and never crosses one. `pattern` is the layer's sliding window, sinks and softcap (patterns.py); which kernel takes
which is decided before the model is built (support.py), and each kernel refuses what it cannot do.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from . import gated_delta_op, ring
from .fa4_op import FORWARD_OP, VARLEN_FORWARD_OP, fa4_attention, fa4_varlen_attention
from .patterns import FULL, Pattern, patterned_sdpa


def _per_document(kernel, q, k, v, scale, docs):
    """Runs a dense causal kernel on each document separately (exact; efficient for book-length documents)."""
    rows = []
    for b, lengths in enumerate(docs):
        pieces, start = [], 0
        for n in lengths:
            cut = slice(start, start + n)
            pieces.append(kernel(q[b:b + 1, :, cut], k[b:b + 1, :, cut], v[b:b + 1, :, cut], scale, None))
            start += n
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)


def _sdpa(q, k, v, scale: float, docs=None, pattern: Pattern = FULL) -> torch.Tensor:
    if not pattern.plain:
        return patterned_sdpa(q, k, v, scale, docs, pattern)
    if docs is not None:
        return _per_document(_sdpa, q, k, v, scale, docs)
    if k.shape[1] != q.shape[1] and q.is_cuda and q.dtype == torch.float32:
        # fp32 on CUDA: no fused backend takes GQA, and the math fallback would hold the whole score matrix (and
        # escape --attn_recompute never): give every query head its own k and v instead
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    # GQA without copying k and v to every query head: cuDNN takes it at the same speed (H200, torch 2.11: 0.22 s
    # forward+backward at 64k tokens either way) and the copies and their gradients cost 2 x (heads - kv) x s x d
    # each (benchmarks/attn_bench.py, docs/benchmarks.md)
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa).transpose(1, 2)


def _cu_seqlens(docs, device) -> tuple[torch.Tensor, int]:
    """Every batch row's documents, one after the other: their int32 start offsets and the total, the longest."""
    lengths = [n for row in docs for n in row]
    cu = F.pad(torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    return cu.to(device), max(lengths)


def _fa2_pattern(pattern: Pattern) -> dict:
    """FA2's window and softcap arguments; it has no sinks (the support check sends sink models elsewhere)."""
    if pattern.sinks is not None:
        raise ValueError("FA2 has no attention sinks: use --attn_kernel flash_attn_4 or sdpa")
    window = (-1, -1) if pattern.window is None else (pattern.window_left, 0)
    return {"window_size": window, "softcap": pattern.softcap or 0.0}


def _flash_attn(q, k, v, scale: float, docs=None, pattern: Pattern = FULL) -> torch.Tensor:
    from flash_attn import flash_attn_func, flash_attn_varlen_func  # FA2 (and FA3's compatible interface)

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, s, h, d), the layout FlashAttention takes
    extra = _fa2_pattern(pattern)
    if docs is None:
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=True, **extra)
    cu, longest = _cu_seqlens(docs, q.device)
    b, s = q.shape[:2]
    out = flash_attn_varlen_func(*(t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)), cu, cu, longest, longest,
                                 softmax_scale=scale, causal=True, **extra)
    return out.reshape(b, s, *out.shape[1:])


def _flash_attn_4(q, k, v, scale: float, docs=None, pattern: Pattern = FULL) -> torch.Tensor:
    """FlashAttention-4 (package flash-attn-4) through our registered ops, so that its outputs can be kept; packed
    documents in one varlen call. Its window, softcap and learnable sinks have backward kernels on Hopper."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, s, h, d) views, GQA native
    extra = (pattern.window_left, pattern.softcap or 0.0,
             None if pattern.sinks is None else pattern.sinks.float().contiguous())
    if docs is None:
        return fa4_attention(q, k, v, scale, *extra)
    cu, longest = _cu_seqlens(docs, q.device)
    b, s = q.shape[:2]
    # (b, s, h, d) -> (b*s, h, d): a copy where the all-to-all left q, k, v strided, as the kernel needs
    out = fa4_varlen_attention(*(t.reshape(b * s, *t.shape[2:]).contiguous() for t in (q, k, v)), cu, longest, scale,
                               *extra)
    return out.view(b, s, *out.shape[1:])


KERNELS: dict[str, Callable] = {"sdpa": _sdpa, "flash_attn": _flash_attn, "flash_attn_4": _flash_attn_4}
ATTN_KERNELS = ("auto", *KERNELS)  # the choices of --attn_kernel
# the module whose presence means the kernel is installed (FA4 also installs `flash_attn` as a namespace package,
# so FA2 is recognised by its own interface module)
_KERNEL_MODULES = {"sdpa": None, "flash_attn": "flash_attn.flash_attn_interface", "flash_attn_4": "flash_attn.cute"}


def kernel_available(name: str) -> bool:
    return kernel_problem(name) is None


def kernel_problem(name: str) -> Optional[str]:
    """None where the kernel's package imports here, else why not: "not installed", or the error its import raises
    (a package found but broken, such as FA4 without its CuTe DSL libraries: `auto` then runs SDPA rather than fail
    at the first layer)."""
    module = _KERNEL_MODULES[name]
    return None if module is None else _import_problem(module)


@functools.lru_cache(maxsize=None)
def _import_problem(module: str) -> Optional[str]:
    try:
        if importlib.util.find_spec(module) is None:
            return "not installed"
    except ModuleNotFoundError:
        return "not installed"
    try:
        importlib.import_module(module)
    except Exception as e:  # any failure to import means the kernel cannot run here
        return f"installed but its import fails ({type(e).__name__}: {e})"
    return None


FLASH_MAX_HEAD_DIM = 256  # FA2's and FA4's (on SM90) widest head; Gemma 4's global layers have 512


def resolve_kernel(name: str, device_type: str, half_precision: bool = True,
                   capability: tuple[int, int] = (0, 0), head_dim: int = 0, assume_installed: bool = False) -> str:
    """`auto` is FlashAttention-4 where it runs (installed, a CUDA GPU of compute capability 9.0 or later, bf16 or
    fp16), else SDPA (cuDNN on Hopper): FA4 gives the faster step in the trainer and the faster kernel alone
    (docs/benchmarks.md, "Attention kernels"), and where every attention layer's heads (`head_dim`, the widest)
    fit it. At head_dim 256 on Hopper (Qwen3.5, Qwen3-Next, Gemma 3's global layers) FA4's backward is the slower
    one; our FA4 op runs cuDNN's backward from FA4's forward there (fa4_op.py: cudnn_backward_is_faster), so FA4 is
    the faster choice at every head size it takes. FA4 goes through our registered op, so its outputs are kept like
    SDPA's. An explicit choice that is not installed, or cannot run here, is an error naming the flag.
    `assume_installed`: the packages are taken as installed (a planned machine, not this one)."""
    def installed(kernel: str) -> bool:
        return assume_installed or kernel_available(kernel)

    if name == "auto":
        fa4_fits = (device_type == "cuda" and half_precision and tuple(capability) >= (9, 0)
                    and head_dim <= FLASH_MAX_HEAD_DIM)
        if not fa4_fits:
            return "sdpa"
        if installed("flash_attn_4"):
            return "flash_attn_4"
        problem = kernel_problem("flash_attn_4")
        if problem != "not installed":
            warnings.warn(f"--attn_kernel auto runs SDPA: flash-attn-4 is {problem}")
        return "sdpa"
    if name in ("flash_attn", "flash_attn_4") and head_dim > FLASH_MAX_HEAD_DIM:
        raise ConfigError(f"--attn_kernel {name} takes heads of up to {FLASH_MAX_HEAD_DIM}, and this model has "
                          f"attention heads of {head_dim}: use --attn_kernel sdpa (or auto)")
    if name not in KERNELS:
        raise ConfigError(f"--attn_kernel {name}: choose one of auto, {', '.join(KERNELS)}")
    if not installed(name):
        pkg = {"flash_attn": "flash-attn", "flash_attn_4": "flash-attn-4"}[name]
        raise ConfigError(f"--attn_kernel {name} needs the {pkg} package, which is {kernel_problem(name)}: "
                          f"pip install {pkg}, or use --attn_kernel auto")
    if device_type != "cuda" and name != "sdpa":
        raise ConfigError(f"--attn_kernel {name} runs on CUDA GPUs only: use --attn_kernel sdpa on {device_type}")
    if name != "sdpa" and not half_precision:
        raise ConfigError(f"--attn_kernel {name} runs in bf16/fp16 only: pass --dtype bf16, or --attn_kernel sdpa")
    return name


# the attention kernels as the dispatcher sees them (what selective checkpointing keeps under --attn_recompute never,
# and the offload moves): every SDPA backend, our FA4 op, our ring op and the flash_attn package's
ATTENTION_OPS = [getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name)]
ATTENTION_OPS += [FORWARD_OP, VARLEN_FORWARD_OP, ring.FORWARD_OP]
try:
    ATTENTION_OPS.append(torch.ops.flash_attn._flash_attn_forward.default)
except (AttributeError, RuntimeError):
    pass
# the Gated DeltaNet layers' recurrence as the dispatcher sees it: our op of FLA's gated delta rule
LINEAR_ATTENTION_OPS = [gated_delta_op.FORWARD_OP]
