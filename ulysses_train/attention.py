"""Ulysses attention for any Hugging Face decoder, through transformers' attention interface.

`register_ulysses_attention(sp_group, kernel)` registers the name "ulysses" with `AttentionInterface` (and a mask
function that builds no mask, since the kernel applies causality itself over the *gathered* sequence, which a mask
built from the local shard could not describe). A model loaded with `attn_implementation="ulysses"`, or switched
with `model.set_attn_implementation("ulysses")`, then runs:

    q (b, h, s/sp, d), k/v (b, kv, s/sp, d)
      -> [replicate KV heads if kv < sp] -> all-to-all -> q (b, h/sp, s, d), k/v (b, kv/sp or 1, s, d)
      -> local kernel over the whole sequence for this rank's heads -> (b, s, h/sp, d)
      -> all-to-all -> (b, s/sp, h, d)

Head blocks are contiguous, so rank r holds query heads [r*h/sp, (r+1)*h/sp) and exactly the KV heads those
query heads use: with g = h/kv query heads per KV head, query head i reads KV head i // g, and the block of rank r
reads KV heads [r*kv/sp, (r+1)*kv/sp) when sp divides kv, or KV head r*kv/sp (one, after replicating each KV head
sp/kv times) when kv divides sp.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .all_to_all import all_to_all, group_size
from .config import ConfigError
from .fa4_op import fa4_attention

ATTN_NAME = "ulysses"

# ---------------------------------------------------------------- local kernels
# Each takes q (b, hq, s, d), k/v (b, hkv, s, d) for the full sequence and returns (b, s, hq, d), causal.
# `docs`, when packing, gives per batch row the lengths of its documents (summing to s): attention is causal inside
# each document and never crosses one.


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


def _sdpa(q, k, v, scale: float, docs=None) -> torch.Tensor:
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


def _flash_attn(q, k, v, scale: float, docs=None) -> torch.Tensor:
    from flash_attn import flash_attn_func, flash_attn_varlen_func  # FA2 (and FA3's compatible interface)

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, s, h, d), the layout FlashAttention takes
    if docs is None:
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    lengths = torch.tensor([n for row in docs for n in row], device=q.device, dtype=torch.int32)
    cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    b, s = q.shape[:2]
    out = flash_attn_varlen_func(*(t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)), cu, cu,
                                 int(lengths.max()), int(lengths.max()), softmax_scale=scale, causal=True)
    return out.reshape(b, s, *out.shape[1:])


def _flash_attn_4(q, k, v, scale: float, docs=None) -> torch.Tensor:
    """FlashAttention-4 (package flash-attn-4) through our registered op, so that its outputs can be kept."""
    if docs is not None:
        return _per_document(_flash_attn_4, q, k, v, scale, docs)
    return fa4_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale)  # (b, s, h, d) views, GQA native


KERNELS: dict[str, Callable] = {"sdpa": _sdpa, "flash_attn": _flash_attn, "flash_attn_4": _flash_attn_4}
# the module whose presence means the kernel is installed (FA4 also installs `flash_attn` as a namespace package,
# so FA2 is recognised by its own interface module)
_KERNEL_MODULES = {"sdpa": None, "flash_attn": "flash_attn.flash_attn_interface", "flash_attn_4": "flash_attn.cute"}


def kernel_available(name: str) -> bool:
    module = _KERNEL_MODULES[name]
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def resolve_kernel(name: str, device_type: str, half_precision: bool = True,
                   capability: tuple[int, int] = (0, 0)) -> str:
    """`auto` is FlashAttention-4 where it runs (installed, a CUDA GPU of compute capability 9.0 or later, bf16 or
    fp16), else SDPA (cuDNN on Hopper). Measured on the H200 in the trainer (docs/benchmarks.md, session 4), Qwen3-4B
    with kept attention outputs: FA4 12.53 s against cuDNN 13.68 s per step at 64k tokens, 40.06 against 44.83 at
    131k; the kernels alone run at 617-628 TFLOP/s against 541-552; FA2 measured ~325. FA4 goes through our
    registered op (fa4_op.py), so its outputs are kept like SDPA's. An explicit choice that is not installed, or
    cannot run here, is an error naming the flag."""
    if name == "auto":
        fa4_runs = (device_type == "cuda" and half_precision and tuple(capability) >= (9, 0)
                    and kernel_available("flash_attn_4"))
        return "flash_attn_4" if fa4_runs else "sdpa"
    if name not in KERNELS:
        raise ConfigError(f"--attn_kernel {name}: choose one of auto, {', '.join(KERNELS)}")
    if not kernel_available(name):
        pkg = {"flash_attn": "flash-attn", "flash_attn_4": "flash-attn-4"}[name]
        raise ConfigError(f"--attn_kernel {name} needs the {pkg} package, which is not installed: "
                          f"pip install {pkg}, or use --attn_kernel auto")
    if device_type != "cuda" and name != "sdpa":
        raise ConfigError(f"--attn_kernel {name} runs on CUDA GPUs only: use --attn_kernel sdpa on {device_type}")
    if name != "sdpa" and not half_precision:
        raise ConfigError(f"--attn_kernel {name} runs in bf16/fp16 only: pass --dtype bf16, or --attn_kernel sdpa")
    return name


# ---------------------------------------------------------------- the wrapper


class UlyssesAttention:
    """The attention function transformers calls, as `fn(module, query, key, value, attention_mask, **kw)`.

    `sp_group` is the process group of the ranks sharing one sequence (None or size 1: plain local attention)."""

    def __init__(self, sp_group, kernel: str = "sdpa"):
        self.sp_group = sp_group
        self.sp = group_size(sp_group)
        self.kernel_name = kernel
        self.kernel = KERNELS[kernel]
        # packed documents of the current batch, global (whole-sequence) lengths per row; None: one causal sequence.
        # Set by the caller before the forward and kept until the next batch (checkpoint recompute reads it again).
        self.doc_lengths: Optional[list[list[int]]] = None

    def __call__(self, module, query, key, value, attention_mask, dropout: float = 0.0,
                 scaling: Optional[float] = None, sliding_window: Optional[int] = None, **kwargs):
        if sliding_window is not None:
            raise NotImplementedError("Ulysses attention supports full-attention layers only (sliding_window is set)")
        if dropout:
            raise NotImplementedError("attention dropout is not supported: set the model's attention_dropout to 0")
        if attention_mask is not None:
            raise NotImplementedError("padding masks are not supported: pad at the end with labels -100 instead")
        sp, kv_heads = self.sp, key.shape[1]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if kv_heads % sp != 0:
            # kv divides sp (checked at start-up): give each KV head to sp/kv consecutive ranks
            key, value = (t.repeat_interleave(sp // kv_heads, dim=1) for t in (key, value))
        # (b, h, s/sp, d) -> (b, h/sp, s, d)
        q, k, v = (all_to_all(t, self.sp_group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
        out = self.kernel(q, k, v, scale, self.doc_lengths)  # (b, s, h/sp, d)
        # (b, s, h/sp, d) -> (b, s/sp, h, d)
        return all_to_all(out, self.sp_group, scatter_dim=1, gather_dim=2), None


def _no_mask(*args, **kwargs):
    """Mask function for the "ulysses" name: no mask tensor; causality is applied by the kernel."""
    return None


def register_ulysses_attention(sp_group, kernel: str = "sdpa") -> UlyssesAttention:
    """Registers "ulysses" with transformers' attention and mask interfaces; returns the live wrapper."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    attn = UlyssesAttention(sp_group, kernel)
    AttentionInterface.register(ATTN_NAME, attn)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)
    return attn
