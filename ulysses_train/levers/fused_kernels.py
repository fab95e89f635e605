"""Fused Triton kernels for the per-token elementwise work of a decoder layer (`--fused_kernels`).

Why our own: without them a long-context step spends seconds in small unfused elementwise kernels (measured in
docs/benchmarks.md, "Our fused kernels against the ops they replace"), most of them from three places:

- the RMSNorms (four per Qwen3 layer: before attention and MLP, and per head on q and k), which upcast, square,
  average, scale, downcast and multiply by the weight in seven kernels each way, several of them non-vectorised
  because a per-row or per-column factor is broadcast;
- the rotary embedding, which runs `x * cos + cat(-x2, x1) * sin` as five kernels on the transposed (strided)
  q and k, each of them non-vectorised;
- the gated MLP's product act(gate) * up, two kernels forward and three backward over seq x intermediate values.

Each layer runs them three times (forward, recomputed forward, backward). Here each is one kernel per tensor and
direction that reads its input once and writes its output once:

- `rms_norm`: the lean RMSNorm of lean_norm.py in each of its rules (the forward arithmetic of transformers' Llama,
  T5 and zero-centred RMSNorms; it saves the input in its own dtype and one fp32 number per row), with
  head-sized rows (q/k norms) batched many per program and the weight's gradient summed per program in registers.
- `RotaryFunction`: rotary embedding on q or k in whatever layout they come in (the (b, h, s, d) view of the
  projection's (b, s, h, d) memory), writing the output in that same layout, so the attention's transpose back to
  (b, s, h, d) is free. The backward is the same kernel with the rotation reversed; only cos and sin are saved.
- `GatedMulFunction`: the gated MLP's act(gate) * up (SwiGLU's silu, Gemma's tanh GELU) in one pass each way,
  saving gate and up (autograd's version also saves act(gate): one seq x intermediate tensor less in the recomputed
  layer).

Liger-Kernel ships similar kernels (benchmarks/kernel_bench.py; the comparison is in docs/benchmarks.md, "Kernels:
ours against Liger-Kernel and eager PyTorch"): Liger's rotary rounds each product to the bf16 of cos and sin, where
ours computes in fp32 and rounds once. Ours keep lean_norm's saving and layout rules,
stay within the ops the trainer already patches, and run on the CPU through Triton's interpreter (TRITON_INTERPRET=1),
where the tests compare them with transformers' own functions, forward and backward. Liger's fused linear cross-entropy,
faster than our loss, is the default loss on CUDA (levers/loss.py). Triton is imported only when a kernel first runs.
What they save in a step: docs/benchmarks.md ("Our fused kernels against the ops they replace").
"""

from __future__ import annotations

import functools
import os
import types
from typing import Optional

import torch

from .lean_norm import LLAMA, NormRule, norm_epsilon


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Triton's interpreter runs kernels on CPU tensors (for tests); it is read when the kernels are defined."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_run_on(device: torch.device) -> bool:
    """Whether our Triton kernels can run on tensors of this device in this process."""
    if not triton_importable():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


@functools.lru_cache(maxsize=None)
def _kernels():
    """Defines the kernels on first use, so that importing this module needs no Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_forward(X, W, Y, RSTD, Z, M, N, sx, sz, eps, offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    ROUND_FIRST: tl.constexpr, GATED: tl.constexpr, ROUND_PRODUCT: tl.constexpr):
        # X: rows `sx` apart (a strided view: Qwen3.5's q between its gates); Y: dense; Z: the gate, rows `sz` apart
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(X + rows.to(tl.int64)[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)  # (BLOCK_M,)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        if ROUND_FIRST:  # Llama: weight * (x * rstd).to(input dtype), the product rounded to the output dtype
            normed = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
            y = w[None, :] * normed
        else:  # T5, zero-centred: ((weight + offset) * x * rstd) in fp32, rounded once
            y = (x * rstd[:, None]) * (w + offset)[None, :]
        if GATED:  # the gated norm: that product (rounded where weight and x give a 16-bit one) x silu(z) in fp32
            if ROUND_PRODUCT:
                y = y.to(X.dtype.element_ty).to(tl.float32)
            z = tl.load(Z + rows.to(tl.int64)[:, None] * sz + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = y * (z * tl.sigmoid(z))
        tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rows < M)

    @triton.jit
    def rms_backward(DY, X, W, RSTD, Z, DX, DW, DZ, M, N, sx, sz, rows_per_program, offset,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_FIRST: tl.constexpr, GATED: tl.constexpr,
                     ROUND_PRODUCT: tl.constexpr):
        # each program walks its own run of rows and keeps its share of the weight's gradient in registers
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32) + offset
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        first = program * rows_per_program
        for start in range(0, rows_per_program, BLOCK_M):
            rows = first + start + tl.arange(0, BLOCK_M)
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
            x = tl.load(X + rows.to(tl.int64)[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
            normed = x * rstd[:, None]
            scaled = normed.to(X.dtype.element_ty).to(tl.float32) if ROUND_FIRST else normed  # what w multiplies
            if GATED:  # dy reaches the norm's product through silu(z); z's gradient needs that product again
                z = tl.load(Z + rows.to(tl.int64)[:, None] * sz + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                sig = tl.sigmoid(z)
                product = w[None, :] * scaled
                if ROUND_PRODUCT:
                    product = product.to(X.dtype.element_ty).to(tl.float32)
                tl.store(DZ + offsets, (dy * product * sig * (1 + z * (1 - sig))).to(DZ.dtype.element_ty), mask=mask)
                dy = dy * z * sig
            dw += tl.sum(dy * scaled, axis=0)
            g = dy * w[None, :]  # the gradient reaching the fp32 normalised values
            dx = rstd[:, None] * (g - normed * (tl.sum(g * normed, axis=1) / N)[:, None])
            tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DW + program.to(tl.int64) * N + cols, dw, mask=cols < N)

    @triton.jit
    def rotary(X, COS, SIN, Y, H, sxb, sxh, sxs, sxd, syb, syh, sy_s, syd, scb, scs, scd,
               HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, REVERSE: tl.constexpr):
        # one program per token (s, b): all heads x both halves of the head dimension
        s, b = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        heads, d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
        dmask = d < HALF
        c = COS + b * scb + s * scs + d * scd
        n = SIN + b * scb + s * scs + d * scd
        cos1 = tl.load(c, mask=dmask, other=0.0).to(tl.float32)[None, :]
        cos2 = tl.load(c + HALF * scd, mask=dmask, other=0.0).to(tl.float32)[None, :]
        sin1 = tl.load(n, mask=dmask, other=0.0).to(tl.float32)[None, :]
        sin2 = tl.load(n + HALF * scd, mask=dmask, other=0.0).to(tl.float32)[None, :]
        mask = (heads < H)[:, None] & dmask[None, :]
        heads = heads.to(tl.int64)  # a contiguous (b, h, s, d) x has a head stride of s x d
        x = X + b * sxb + s * sxs + heads[:, None] * sxh + d[None, :] * sxd
        x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x + HALF * sxd, mask=mask, other=0.0).to(tl.float32)
        if REVERSE:  # the backward: the transpose of the rotation
            y1, y2 = x1 * cos1 + x2 * sin2, x2 * cos2 - x1 * sin1
        else:  # x * cos + cat(-x2, x1) * sin
            y1, y2 = x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2
        y = Y + b * syb + s * sy_s + heads[:, None] * syh + d[None, :] * syd
        tl.store(y, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(y + HALF * syd, y2.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def gated_mul(G, U, DH, OUT, DU, n, BLOCK: tl.constexpr, BACKWARD: tl.constexpr, GELU: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offsets, mask=mask, other=0.0).to(tl.float32)
        if GELU:  # the tanh approximation: 0.5 g (1 + tanh(c (g + 0.044715 g^3))), tanh(z) = 2 sigmoid(2z) - 1
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
            act32 = 0.5 * g * (1.0 + t)
            slope = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
        else:  # silu
            sig = tl.sigmoid(g)
            act32 = g * sig
            slope = sig * (1 + g * (1 - sig))
        act = act32.to(G.dtype.element_ty).to(tl.float32)  # transformers rounds act(g) before the product
        if BACKWARD:  # OUT: the gate's gradient, DU: the up projection's
            dh = tl.load(DH + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(OUT + offsets, (dh * u * slope).to(OUT.dtype.element_ty), mask=mask)
            tl.store(DU + offsets, (dh * act).to(DU.dtype.element_ty), mask=mask)
        else:
            tl.store(OUT + offsets, (act * u).to(OUT.dtype.element_ty), mask=mask)

    return types.SimpleNamespace(rms_forward=rms_forward, rms_backward=rms_backward, rotary=rotary,
                                 gated_mul=gated_mul)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _row_blocks(n: int) -> tuple[int, int, int]:
    """(rows per block, padded row length, warps): about 4096 values per program, so 128-wide head rows go 32 at a
    time and a 2560-wide hidden row alone."""
    block_n = _next_pow2(n)
    block_m = max(1, 4096 // block_n)
    return block_m, block_n, 8 if block_m * block_n >= 4096 else 4


def _programs_for(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter runs programs one after another


def _as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(m, n) rows of t, a view where its last dimension is dense (rows may lie apart), else a copy."""
    rows = t.reshape(-1, n)
    return rows if rows.stride(1) == 1 else rows.contiguous()


class RMSNormFunction(torch.autograd.Function):
    """An RMSNorm over the last dimension by `rule` (lean_norm.NormRule: Llama's, T5's or zero-centred); saves x and
    one fp32 number per row. With `gate`: the gated norm of the Gated DeltaNet layers (Qwen3.5, Qwen3-Next), the
    norm's product times silu(gate) in fp32, returned in x's dtype; it saves the gate too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, rule: NormRule = LLAMA,
                gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        n = x.shape[-1]
        rows = _as_rows(x, n)  # a view for the inputs a decoder layer gives, maybe with rows apart
        gates = None if gate is None else _as_rows(gate, n)
        product_dtype = torch.result_type(weight, x) if rule.round_first else x.dtype
        round_product = product_dtype != torch.float32  # the gated norm rounds the product where it is 16-bit
        out = torch.empty(rows.shape, dtype=x.dtype if gate is not None else product_dtype, device=x.device)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        block_m, block_n, warps = _row_blocks(n)
        grid = (triton_cdiv(rows.shape[0], block_m),)
        _kernels().rms_forward[grid](rows, weight, out, rstd, rows if gates is None else gates, rows.shape[0], n,
                                     rows.stride(0), 0 if gates is None else gates.stride(0), eps, rule.offset,
                                     BLOCK_M=block_m, BLOCK_N=block_n, ROUND_FIRST=rule.round_first,
                                     GATED=gates is not None, ROUND_PRODUCT=round_product,
                                     num_warps=warps)
        ctx.save_for_backward(rows, weight, rstd, gates)
        ctx.x_shape, ctx.rule, ctx.round_product = x.shape, rule, round_product
        return out.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        rows, weight, rstd, gates = ctx.saved_tensors
        m, n = rows.shape
        dy = grad_out.reshape(m, n).contiguous()
        dx = torch.empty((m, n), dtype=rows.dtype, device=rows.device)
        dz = None if gates is None else torch.empty((m, n), dtype=gates.dtype, device=rows.device)
        block_m, block_n, warps = _row_blocks(n)
        blocks = triton_cdiv(m, block_m)
        programs = min(blocks, _programs_for(rows.device))
        rows_per_program = triton_cdiv(blocks, programs) * block_m
        programs = triton_cdiv(m, rows_per_program)
        dw = torch.empty(programs, n, dtype=torch.float32, device=rows.device)
        _kernels().rms_backward[(programs,)](dy, rows, weight, rstd, rows if gates is None else gates, dx, dw,
                                             dx if dz is None else dz, m, n, rows.stride(0),
                                             0 if gates is None else gates.stride(0), rows_per_program,
                                             ctx.rule.offset, BLOCK_M=block_m, BLOCK_N=block_n,
                                             ROUND_FIRST=ctx.rule.round_first, GATED=gates is not None,
                                             ROUND_PRODUCT=ctx.round_product, num_warps=warps)
        grad_weight = dw.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_gate = None if dz is None else dz.view(ctx.x_shape)
        return dx.view(ctx.x_shape), grad_weight, None, None, grad_gate


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, rule: NormRule = LLAMA) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps, rule)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' gated RMSNorm (Qwen3.5's and Qwen3-Next's `RMSNormGated`, silu): weight * norm(x) rounded to
    x's dtype as Llama's norm, times silu(gate) in fp32, in x's dtype; one kernel each way instead of about a dozen
    over fp32 copies of (tokens x value width) values."""
    if gate.shape != x.shape:
        raise ValueError(f"the gate's shape {tuple(gate.shape)} is not the input's {tuple(x.shape)}")
    return RMSNormFunction.apply(x, weight, eps, LLAMA, gate)


def _launch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype, reverse: bool):
    """x: (b, h, s, d) in any strides; cos, sin: (b or 1, s, d). The output has x's strides when x is dense."""
    b, h, s, d = x.shape
    out = torch.empty_like(x, dtype=out_dtype)  # preserve_format keeps a dense x's strides
    cos, sin = cos.expand(b, s, d), sin.expand(b, s, d)
    assert cos.stride() == sin.stride()
    half = d // 2
    _kernels().rotary[(s, b)](x, cos, sin, out, h, *x.stride(), *out.stride(), *cos.stride(),
                              HALF=half, BLOCK_H=_next_pow2(h), BLOCK_D=_next_pow2(half), REVERSE=reverse,
                              num_warps=4 if h * d >= 2048 else 2)
    return out


class RotaryFunction(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin for one of q, k (b, h, s, d), computed in fp32 and rounded once to `out_dtype`
    (None: the promoted dtype of x and cos); only cos and sin are saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _launch_rotary(x, cos, sin, out_dtype or torch.result_type(x, cos), reverse=False)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _launch_rotary(grad_out, cos, sin, ctx.x_dtype, reverse=True), None, None, None


def rotary_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> bool:
    """The standard layout (q, k: (b, h, s, d); cos, sin: (b or 1, s, d) without gradients, full head dim)."""
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    if cos.requires_grad or sin.requires_grad or not kernels_run_on(q.device):
        return False
    return all(t.shape[-1] == cos.shape[-1] and t.shape[-2] == cos.shape[-2] and t.shape[-1] % 2 == 0
               for t in (q, k)) and cos.shape[0] in (1, q.shape[0])


class GatedMulFunction(torch.autograd.Function):
    """act(gate) * up, a gated MLP's product (SwiGLU: act = silu; GeGLU: act = GELU's tanh approximation, Gemma's),
    saving gate and up only (autograd's version also saves act(gate))."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        _launch_gated_mul(gate, up, None, out, None, act)
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        _launch_gated_mul(gate, up, grad_out.contiguous(), grad_gate, grad_up, ctx.act)
        return grad_gate, grad_up, None


GATED_ACTIVATIONS = ("silu", "gelu_tanh")  # what the kernel computes for act


def _launch_gated_mul(gate, up, grad_out, out, grad_up, act: str):
    if act not in GATED_ACTIVATIONS:
        raise ValueError(f"gated_mul computes {GATED_ACTIVATIONS}, not {act!r}")
    n, block = gate.numel(), 2048
    _kernels().gated_mul[(triton_cdiv(n, block),)](gate, up, grad_out if grad_out is not None else gate, out,
                                                   grad_up if grad_up is not None else out, n, BLOCK=block,
                                                   BACKWARD=grad_out is not None, GELU=act == "gelu_tanh",
                                                   num_warps=8)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fused_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The forward of an RMSNorm module as one Triton kernel each way (`--fused_kernels`; model/surgery.py installs
    it and sets `_norm_rule`, as for lean_norm.lean_forward)."""
    return rms_norm(hidden_states, self.weight, norm_epsilon(self), self._norm_rule)
