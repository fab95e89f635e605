"""Planner: will this run fit, which levers does it need, how many GPUs, how long will a step take?

    python -m ulysses_train.plan --model_config qwen3-8b --seq_len 1048576 --gpus 8 [--sp_size N] [--ring_size R]
        [--ds_config F]
    python -m ulysses_train.plan --model_config qwen3-4b --gpus 1 --longest    # how long can one GPU go?
    python -m ulysses_train.plan --model_config qwen3-8b --gpus 1 --longest --use_peft [--load_in_4bit]   # LoRA
    python -m ulysses_train.plan --gpus 8 [--fastest] -- <flags of launch/train.py>   # that run (tools/plan_command.py)
    python -m ulysses_train.plan --calibrate FILE        # measure this machine's time constants (tools/calibrate.py)

Per GPU and for the host it estimates model states (ZeRO stage, precision of the optimizer states, CPU offload),
the saved layer checkpoints (on the GPU or offloaded), kept attention outputs, the working set of the layer being
recomputed (attention, MLP tiled or not), the loss, the all-to-all buffers and, with a ring, the K/V blocks in flight
and their fp32 gradient accumulators; and what each rank sends per step (all-to-all and ring point-to-point). It
first says what the default flags do (the levers come from the same policy as the trainer's, levers/policy.py),
then the cheapest levers that fit. Where the heads forbid a pure Ulysses split of an SP size, it plans that size
with the ring `--ring_size auto` would choose. The formulas are in docs/memory.md with a comparison against the
peaks measured on the H200."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

from ..errors import ConfigError
from ..sp.support import FAMILIES
from ..levers.policy import GiB, DeviceInfo, LeverRequest, Levers, checkpoint_bytes, kept_attention_bytes, \
    resolve_levers
from ..model.adapters import NF4_BYTES
from ..model.geometry import geometry
from ..sp.dims import check_heads, resolve_ring_size, valid_sp_sizes, validate
from ..train.config import ring_size_number
from .layer_activations import kept_layer_bytes, uncheckpointed_backward_bytes
from ..train.ds_config import lever_choices, load_ds_config

CUDA_OVERHEAD = 1.5 * GiB  # CUDA context, cuBLAS/cuDNN workspaces, allocator slack
# The recomputed layer's attention block, at its peak in the backward, holds about this many (tokens x heads*head_dim)
# bf16 tensors, plus the fp32 copies that transformers' RMSNorms keep of their inputs (the layer's input norm and
# Qwen3's q and k norms; none with --lean_norm). Fitted (one number) on ten H200 peaks measured with transformers'
# norms, where the whole block came out at 19.6-21.5 such tensors for 64k-524k tokens per rank (20 for Qwen3-4B,
# largest error 2.2%), of which the fp32 norm copies are 3.75. Counted by hand the rest reaches ~16: q, k and v after
# projection, the norms' bf16 outputs, rotary temporaries, k and v expanded to all heads, the output and its layout
# copy, dq, expanded dk and dv, cuDNN's fp32 dq accumulator (2).
ATTENTION_TENSORS = 16.25
# The same block with GQA handed to the kernel as is (`enable_gqa` in bf16/fp16, and FA4), instead of k and v
# copied to every query head: measured on the H200 at 8.5 units (131k tokens, SP=1) and 6.5
# (1M tokens, SP=2); 7.5 is used (docs/memory.md). More than the copies themselves (k, v, dk, dv at full width,
# 4 units): the expanded path also held cuDNN's full-width gradient buffers. Models without GQA keep 16.25
# (not measured without the copies).
ATTENTION_TENSORS_GQA = 7.5
# Our fused rotary (--fused_kernels) writes q and k rotated in one pass, without transformers' temporaries (q * cos,
# rotate_half's negated half and concatenation, the product with sin, and their gradients in the backward). Measured
# on the H200 at 131k tokens, where the attention block sets the peak: 44.99 -> 43.70 GiB with the kernels (FA4,
# tiled MLP), 1.29 units; 1.25 is used. The fused SwiGLU saves gate and
# up only, not silu(gate): one (tokens x intermediate) tensor less, 42.25 -> 41.06 GiB at 64k (MLP-bound), exactly it.
FUSED_ROTARY_SAVING = 1.25
# The recomputed Gated DeltaNet mixer (Qwen3.5, Qwen3-Next) at its peak in the backward, in tokens x (2 key + value)
# and tokens x value tensors: the fused projection's output, the convolution's and its SiLU, and their gradients (6);
# the gate z, the recurrence's output, its gated norm, and their gradients (6). Counted by hand, not measured: a
# guess until a GPU run measures it. Beside them the backward recomputes each chunk's state (`deltanet_state_bytes`).
LINEAR_ATTENTION_TENSORS = 6


def liger_chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    """The rows of one chunk of Liger-Kernel's fused linear cross-entropy (0.8.5): the tokens split into
    ceil(vocab / hidden) parts, rounded up to a power of two, so one chunk's logits are about the hidden states'
    size (up to twice it)."""
    parts = -(-vocab // hidden)
    return min(tokens, 1 << max(0, math.ceil(math.log2(-(-tokens // parts)))))


def loss_bytes(g: dict, t: int, kernel: str, loss_chunk: int = 4096, b: int = 2) -> int:
    """The fused loss's peak on one rank of `t` tokens, beyond the model states: the final hidden states and their
    gradient (2 x t x hidden), the head's gradient summed in fp32, and the logits of one chunk.

    ours: fp32 logits, turned into their gradient in place, plus its copy in the activation dtype, for
    --loss_chunk_size rows. liger (from Liger-Kernel 0.8.5's algorithm; to be checked against measured peaks):
    one buffer of logits in the activation dtype, which its kernel overwrites with their gradient, for
    `liger_chunk_rows` rows; one fp32 loss per token; and at the end the fp32 head gradient cast to the weight's
    dtype while both exist, which is the larger term when the chunk's logits are smaller than the head.

    Under --use_peft (`g["adapters"]`) a frozen head has no gradient (neither kernel makes one); a LoRA'd head runs
    as one head of hidden + r columns (levers/loss.py): that weight's copy and its fp32 gradient."""
    v, h, adapters = g["vocab"], g["hidden"], g.get("adapters")
    head_grad = v * h * 4
    if adapters and adapters["head_lora"]:
        h += adapters["rank"]
        head_grad = v * h * (b + 4)
    elif adapters and not adapters["head_trainable"]:
        head_grad = 0
    states = 2 * t * h * b + head_grad
    if kernel == "liger":
        return states + max(liger_chunk_rows(t, v, h) * v * b, v * h * b if head_grad else 0) + 4 * t
    return states + loss_chunk * v * (4 + b)


def model_state_bytes(g: dict, levers: Levers, w_div: int, g_div: int, o_div: int) -> tuple[float, float]:
    """(per GPU, per rank on the host) bytes of the weights, gradients and optimizer states, partitioned by ZeRO
    (`*_div`: over how many GPUs weights, gradients and optimizer states are split).

    Full fine-tuning: every parameter has all three. --use_peft (`g["adapters"]`): the frozen base only its
    weights, in bf16 (2 bytes; NF4 with --load_in_4bit: half a byte and its block's scale), no gradient, no master,
    no optimizer state; the trainable parameters (adapters and modules trained whole) everything."""
    n, adapters = g["params"], g.get("adapters")
    frozen_bytes = 0.0
    if adapters:
        trained_base = adapters["trainable"] - adapters["lora"]  # modules trained whole: part of g["params"]
        frozen = n - trained_base
        frozen_bytes = (frozen - adapters["quantized"]) * 2 + adapters["quantized"] * NF4_BYTES
        n = adapters["trainable"]
    if levers.offload_optimizer:
        # bf16 weights on the GPU (gradients stream to the host bucket by bucket); on the host fp32 master, Adam m, v
        # and fp32 gradients (16 bytes) and a pinned bf16 copy for the transfers (2): measured 21.0 GiB GPU at 64k
        return (2 * n + frozen_bytes) / w_div, 18 * n / o_div
    # fp32: bf16 weight 2 + bf16 grad 2 + fp32 master 4 + Adam m, v 8; bf16 states: 2 + 2 + Adam 4, and a master
    # copy 2 unless --share_master_weights makes the model's partition the master
    optimizer = (4 if levers.share_master else 6) if levers.bf16_states else 12
    return (2 * n + frozen_bytes) / w_div + 2 * n / g_div + optimizer * n / o_div, 0


def gathered_layer_bytes(g: dict) -> float:
    """ZeRO-3's gathered weights: the layer in use and the prefetched next one; with NF4 weights those, and one
    linear layer's weight dequantized to bf16 for its matmul."""
    adapters = g.get("adapters")
    if adapters and adapters["quantized"]:
        return 2 * g["layer_params"] * NF4_BYTES + 2 * max(g["inter"], g["attn_width"]) * g["hidden"]
    return 2 * 2 * g["layer_params"]


def attention_layers(g: dict, layers: range) -> int:
    """How many of the decoder layers numbered `layers` attend (a Gated DeltaNet layer does not)."""
    return sum(1 for i in layers if g["attn_spans"][i].attention)


def deltanet_bytes(g: dict, t: int, b: int) -> float:
    """A recomputed Gated DeltaNet layer's mixer at its peak in the backward (LINEAR_ATTENTION_TENSORS), and the
    state of every chunk of 64 tokens (value heads x key x value dim), recomputed in the backward with its gradient
    in fp32; 0 for a model without such layers."""
    d = g["linear_attn"]
    if not d:
        return 0
    tensors = LINEAR_ATTENTION_TENSORS * t * (d["conv_width"] + d["value_width"]) * b
    states = 2 * 4 * math.ceil(t / 64) * d["value_heads"] * d["key_head_dim"] * d["value_head_dim"]
    return tensors + states


def ring_bytes(g: dict, t: int, sp: int, ring: int, act_bytes: int) -> int:
    """The ring's buffers of one rank at their peak, in the backward: the K/V block in hand and the next one
    arriving (model dtype), the dK/dV accumulators of the block in hand, the one being sent and the one arriving
    (fp32), and dq's fp32 accumulator. A ring rank attends t x ulysses tokens (its pair of chunks) with heads /
    ulysses query heads and kv / ulysses KV heads (one, replicated, when kv < ulysses)."""
    if ring == 1:
        return 0
    ulysses = sp // ring
    tokens, kv_heads = t * ulysses, max(g["kv"] // ulysses, 1)
    kv_block = 2 * tokens * kv_heads * g["head_dim"]  # k and v, elements
    return 2 * kv_block * act_bytes + 3 * kv_block * 4 + tokens * g["attn_width"] // ulysses * 4


def communication(g: dict, seq_len: int, sp: int, ring: int, levers: Levers, act_bytes: int = 2) -> dict:
    """Bytes one rank sends per sequence (one micro-batch) through the all-to-alls and the ring's point-to-point
    sends, every layer, forward and backward (and the recompute's forward unless attention outputs are kept)."""
    ulysses, t = sp // ring, math.ceil(seq_len / sp)
    forwards = 1 if levers.keep_attention or not levers.checkpointing else 2
    kv_width = max(g["kv_width"], ulysses * g["head_dim"]) if ulysses > 1 else g["kv_width"]
    # q, k, v in and the output back, leaving (u - 1)/u of each; the backward moves their gradients the same way
    a2a = 0 if ulysses == 1 else (2 * g["attn_width"] + 2 * kv_width) * t * act_bytes * (ulysses - 1) // ulysses
    kv_block = 2 * t * ulysses * max(g["kv"] // ulysses, 1) * g["head_dim"]  # elements of a ring rank's k and v
    # forward: R - 1 K/V blocks on; backward: R - 1 K/V blocks again and R fp32 dK/dV accumulators
    p2p = 0 if ring == 1 else (ring - 1) * kv_block * act_bytes
    p2p_backward = 0 if ring == 1 else (ring - 1) * kv_block * act_bytes + ring * kv_block * 4
    layers = attention_layers(g, range(g["layers"]))  # a DeltaNet layer's all-to-alls are not counted here
    return {"all-to-all": layers * a2a * (forwards + 1),
            "ring point-to-point": layers * (p2p * forwards + p2p_backward)}


def estimate(g: dict, seq_len: int, gpus: int, sp: int, levers: Levers, loss_chunk: int = 4096,
             tile_tokens: int = 16384, zero_stage: int = 3, act_bytes: int = 2, ring: int = 1,
             pairs: bool = False) -> dict:
    """Bytes per GPU (and per host, for all local ranks' offloads) of each component; `ring`: --ring_size (sp is
    then Ulysses sp / ring x ring); `pairs`: preference training's head (tools/preference_plan.py)."""
    t = math.ceil(seq_len / sp)  # tokens per rank
    ulysses = sp // ring
    b = act_bytes
    # ZeRO partitions optimizer states from stage 1, gradients from stage 2, weights at stage 3, over all GPUs
    w_div, g_div, o_div = (gpus if zero_stage >= k else 1 for k in (3, 2, 1))
    gpu_states, host_states = model_state_bytes(g, levers, w_div, g_div, o_div)
    gathered = gathered_layer_bytes(g) if zero_stage == 3 else 0
    n_ckpt = min(levers.checkpointed(g["layers"]), g["layers"])
    checkpoints = checkpoint_bytes(g, t, b) * n_ckpt / g["layers"]  # checkpointed layers save their inputs
    # and, with kept outputs, those of their attention kernels (a DeltaNet layer keeps nothing)
    kept = kept_attention_bytes(g, t, b) * attention_layers(g, range(n_ckpt)) / g["layers"] \
        if levers.keep_attention else 0
    # the other layers keep their activations (the last ones: freed by their backward before any recompute starts)
    unchecked = [g["attn_spans"][i] for i in range(n_ckpt, g["layers"])]
    whole_layers = sum(kept_layer_bytes(g, t, b, levers, sp, span) for span in unchecked)
    # the recomputed layer's attention block at its peak, and the fp32 input copies of transformers' norms
    norm_copies = 0 if levers.lean_norm else 4 * t * (g["hidden"] + (g["attn_width"] + g["kv_width"]) * g["qk_norm"])
    units = ATTENTION_TENSORS_GQA if levers.gqa_native and g["kv"] < g["heads"] else ATTENTION_TENSORS
    units -= FUSED_ROTARY_SAVING if levers.fused_kernels else 0
    attention = units * t * g["attn_width"] * b + norm_copies
    mlp_rows = min(t, tile_tokens) if levers.tiled_mlp else t
    # gate, up, act, product + two gradients; the fused SwiGLU keeps no act
    mlp = (5 if levers.fused_kernels else 6) * mlp_rows * g["inter"] * b
    hidden_acts = 8 * t * g["hidden"] * b  # norms, residuals, projections' outputs and their gradients
    layer = hidden_acts + max(attention, mlp, deltanet_bytes(g, t, b))
    loss = loss_bytes(g, t, levers.loss_kernel, loss_chunk, b)
    if pairs:
        from .preference_plan import preference_loss_bytes

        loss = preference_loss_bytes(g, t, loss_chunk, b)
    a2a = 2 * t * (g["attn_width"] + 2 * max(g["kv_width"], g["head_dim"] * ulysses)) * b if ulysses > 1 else 0
    ring_buffers = ring_bytes(g, t, sp, ring, b)
    on_gpu_ckpt = 0 if levers.offload_activations else checkpoints
    on_gpu_kept = 0 if levers.offload_activations else kept  # the offload takes the kept outputs too
    gpu = {"model states": gpu_states + gathered, "checkpoints": on_gpu_ckpt, "kept attention": on_gpu_kept,
           "layer working set": layer, "loss": loss, "all-to-all buffers": a2a}
    if ring > 1:
        gpu["ring buffers"] = ring_buffers
    if whole_layers:
        gpu["uncheckpointed layers"] = whole_layers
    # the loss runs at the end of the forward, the layer working set in the backward: never both at once. The
    # uncheckpointed layers (the last ones) hold their activations through the loss and their own backward, and
    # have freed them by the first recompute (measured on the H200 at 64k and 131k: docs/memory.md)
    transient = max(layer + a2a + ring_buffers, loss)
    if whole_layers:
        own_backward = max(uncheckpointed_backward_bytes(g, t, b, levers, sp, tile_tokens, span)
                           for span in set(unchecked)) + a2a + ring_buffers
        transient = max(transient, whole_layers + max(loss, own_backward))
    gpu_total = gpu["model states"] + on_gpu_ckpt + on_gpu_kept + transient + CUDA_OVERHEAD
    ranks_per_host = min(gpus, 8)
    host = {"optimizer offload": host_states * ranks_per_host,
            "offloaded checkpoints": ((checkpoints if levers.offload_activations else 0) + kept - on_gpu_kept)
            * ranks_per_host}
    return {"tokens_per_rank": t, "ring_size": ring, "gpu": gpu, "gpu_total": gpu_total, "host": host,
            "host_total": sum(host.values()) + 4 * GiB * ranks_per_host,
            "sent_per_sequence": communication(g, seq_len, sp, ring, levers, b)}


# cheapest first: what each costs in step time, as measured (docs/benchmarks.md); (flags, optimizer-state choices)
LEVER_LADDER = [
    (LeverRequest(attn_recompute="never", tiled_mlp="off"), {}),  # kept attention: fastest
    (LeverRequest(attn_recompute="never", tiled_mlp="off", offload_activations=True), {}),  # copies overlap compute
    (LeverRequest(attn_recompute="never", tiled_mlp="on", offload_activations=True), {}),  # one more MLP forward
    (LeverRequest(attn_recompute="never", tiled_mlp="on", offload_activations=True),
     {"bf16_states": True}),  # TRL's precision for optimizer states
    (LeverRequest(attn_recompute="always", tiled_mlp="on", offload_activations=True),
     {"bf16_states": True}),  # ~15% slower
    (LeverRequest(attn_recompute="always", tiled_mlp="on", offload_activations=True), {"offload_optimizer": True}),
]


def ds_config_choices(path: str) -> dict:
    """What a DeepSpeed JSON fixes for the planner: ZeRO stage, bf16 optimizer states, optimizer on the CPU."""
    return lever_choices(load_ds_config(path))


def fits_on(g: dict, seq_len: int, gpus: int, sp: int, gpu_mem: float, host_mem: float, zero_stage: int = 3,
            micro: int = 1, act_bytes: int = 2):
    """Whether given levers fit this run on this machine: what `--checkpoint_layers auto` asks (the trainer and the
    planner pass it to the policy)."""
    def fits_levers(levers: Levers) -> bool:
        est = estimate(g, micro * seq_len, gpus, sp, levers, zero_stage=zero_stage, act_bytes=act_bytes)
        return fits(est, gpu_mem, host_mem)
    return fits_levers


def planned_device(gpus: int, gpu_mem: float, host_mem: float) -> DeviceInfo:
    return DeviceInfo.gpu(gpu_mem / GiB, host_mem / GiB, local_ranks=min(gpus, 8))


def levers_for(request: LeverRequest, g: dict, seq_len: int, gpus: int, sp: int, gpu_mem: float, host_mem: float,
               ds_choices: Optional[dict] = None, micro: int = 1) -> Levers:
    """What the trainer would resolve for these flags on the planned machine (the same policy call)."""
    zero_stage = (ds_choices or {}).get("zero_stage", 3)
    return resolve_levers(request, g, micro * math.ceil(seq_len / sp), 2, planned_device(gpus, gpu_mem, host_mem),
                          ds_choices, fits_on(g, seq_len, gpus, sp, gpu_mem, host_mem, zero_stage, micro))


def _ladder(g: dict, seq_len: int, gpus: int, sp: int, gpu_mem: float, host_mem: float,
            fixed: Optional[dict]) -> list[Levers]:
    """The lever ladder, resolved; with a DeepSpeed config its optimizer choices replace the ladder's, duplicates
    dropped."""
    rungs = []
    for request, states in LEVER_LADDER:
        choices = {**states, **{k: v for k, v in (fixed or {}).items() if k in ("bf16_states", "offload_optimizer")}}
        rung = levers_for(request, g, seq_len, gpus, sp, gpu_mem, host_mem, choices)
        if rung not in rungs:
            rungs.append(rung)
    return rungs


def fits(est: dict, gpu_mem: float, host_mem: float) -> bool:
    return est["gpu_total"] <= 0.95 * gpu_mem and est["host_total"] <= host_mem


def sp_plans(g: dict, gpus: int, sp: Optional[int] = None, ring: Optional[int] = None) -> list[tuple[int, int]]:
    """(sp, ring) for each SP size the planner may try (only `sp` if given), smallest first: the ring `ring`, or by
    default the one --ring_size auto chooses (none where the heads allow a pure Ulysses split)."""
    plans = []
    family = FAMILIES.get(g.get("model_type"))
    for size in [sp] if sp else range(1, gpus + 1):
        if size > 1 and family is not None and not family.sequence_parallel:
            continue  # layers the support check refuses under SP (sp/support.py)
        size_ring = ring or resolve_ring_size("auto", size, g["heads"], g["kv"])
        try:
            validate(gpus, size, g["heads"], g["kv"], ring_size=size_ring)
        except ConfigError:
            continue
        plans.append((size, size_ring))
    return plans


def plan(g: dict, seq_len: int, gpus: int, sp_sizes, gpu_mem: float, host_mem: float,
         ds_choices: Optional[dict] = None) -> tuple:
    """The smallest SP size and the cheapest rung of the ladder that fit: (sp, levers, estimate, everything tried).
    `sp_sizes`: SP sizes, or (sp, ring) pairs (sp_plans); the estimate holds the ring as `ring_size`."""
    tried = []
    zero_stage = (ds_choices or {}).get("zero_stage", 3)
    for entry in sp_sizes:
        sp, ring = entry if isinstance(entry, tuple) else (entry, 1)
        for levers in _ladder(g, seq_len, gpus, sp, gpu_mem, host_mem, ds_choices):
            est = estimate(g, seq_len, gpus, sp, levers, zero_stage=zero_stage, ring=ring)
            tried.append((sp, levers, est, fits(est, gpu_mem, host_mem)))
            if tried[-1][3]:
                return sp, levers, est, tried
    return None, None, None, tried


def longest_fit(g: dict, gpus: int, sp_sizes, gpu_mem: float, host_mem: float, ds_choices: Optional[dict] = None,
                step: int = 8192) -> int:
    """The longest sequence (a multiple of `step`) for which some rung of the ladder fits, 0 if none does. Every
    component grows with the length, so whether anything fits is monotone in it: double, then bisect."""
    def fits(n: int) -> bool:
        return plan(g, n * step, gpus, sp_sizes, gpu_mem, host_mem, ds_choices)[0] is not None

    if not fits(1):
        return 0
    hi = 2
    while fits(hi):
        hi *= 2
    lo = hi // 2  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def default_sp_size(gpus: int) -> int:
    """The trainer's default --sp_size: the ranks of one node (8 GPUs a node here)."""
    return math.gcd(min(gpus, 8), gpus)


def default_flags(g: dict, seq_len: int, gpus: int, sp: Optional[int], gpu_mem: float, host_mem: float,
                  ds_choices: Optional[dict], ring: Optional[int] = None) -> str:
    """What the trainer does with the default lever flags (and --ring_size 1 unless `ring` is given), and whether
    that fits."""
    sp, ring = sp or default_sp_size(gpus), ring or 1
    if not valid_sp_sizes(gpus, g["heads"], g["kv"], sp) and ring == 1:
        auto = resolve_ring_size("auto", sp, g["heads"], g["kv"])
        return (f"with the default flags: --sp_size {sp} does not suit {g['heads']} heads / {g['kv']} KV heads "
                f"without a ring (--ring_size {auto}, or auto)")
    levers = levers_for(LeverRequest(), g, seq_len, gpus, sp, gpu_mem, host_mem, ds_choices)
    est = estimate(g, seq_len, gpus, sp, levers, zero_stage=(ds_choices or {}).get("zero_stage", 3), ring=ring)
    verdict = "fits" if fits(est, gpu_mem, host_mem) else "does not fit"
    return (f"with the default flags (--sp_size {sp}{ring_flag(ring)}): {levers.flags()}, fused kernels "
            f"{levers.fused_kernels}: {est['gpu_total'] / GiB:.1f} GiB per GPU, {est['host_total'] / GiB:.1f} GiB "
            f"host: {verdict}")


def ring_flag(ring: int) -> str:
    return f" --ring_size {ring}" if ring > 1 else ""


def predicted_time(g: dict, seq_len: int, gpus: int, sp: int, levers: Levers, ds_choices: Optional[dict],
                   constants: Optional[str]) -> str:
    """One line: the time model's step time for this plan (tools/time_model.py; FlashAttention-4)."""
    from .time_model import Constants, Run, step_time

    run = Run(g, seq_len, gpus, sp, levers, zero_stage=(ds_choices or {}).get("zero_stage", 3))
    t = step_time(run, Constants.load(constants))
    return (f"predicted step time {t['total']:.1f} s with FlashAttention-4 (attention {t['parts']['attention']:.1f} "
            f"s, communication {100 * t['communication_share']:.1f}%; the fastest plan: add -- <train flags> "
            f"--fastest)")


def _table(rows) -> str:
    return "\n".join(f"  {k:<22} {v / GiB:8.1f} GiB" for k, v in rows)


def _gpu_rows(est: dict, levers: Levers) -> list:
    """The per-GPU components, the loss named with its kernel."""
    return [(f"loss ({levers.loss_kernel})" if k == "loss" else k, v) for k, v in est["gpu"].items()]


def check_numbers(a: argparse.Namespace) -> None:
    """The planner's own flags, before any model is read: a plan of zero tokens, GPUs or memory is no plan."""
    if a.gpus < 1:
        raise ConfigError(f"--gpus must be positive, got {a.gpus}")
    for name in ("gpu_mem_gib", "host_mem_gib"):
        value = getattr(a, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{name} must be a positive finite number, got {value}")
    if not a.longest and a.seq_len is not None and a.seq_len <= 0:
        raise ConfigError(f"--seq_len must be positive, got {a.seq_len}")
    if a.sp_size is not None:
        if a.sp_size < 1:
            raise ConfigError(f"--sp_size must be >= 1, got {a.sp_size}")
        if a.gpus % a.sp_size:
            raise ConfigError(f"--sp_size {a.sp_size} does not divide --gpus {a.gpus}: choose a divisor of {a.gpus} "
                              f"(the remaining factor is data parallel)")
    if a.ring_size is not None and (a.sp_size is None or a.sp_size % a.ring_size):
        raise ConfigError(f"--ring_size {a.ring_size} needs an --sp_size it divides")


def main(argv=None) -> int:
    """The command line; a setting to change is one line on stderr and exit code 2."""
    try:
        return _main(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ulysses_train.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_config", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--num_layers", type=int, default=None)
    p.add_argument("--seq_len", type=int, default=None)
    p.add_argument("--longest", action="store_true",
                   help="instead of --seq_len: find the longest sequence (a multiple of 8192) that fits, and plan it")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--sp_size", type=int, default=None)
    p.add_argument("--ring_size", default="auto",
                   help="a number, or auto (default): a ring only where the heads forbid a pure Ulysses split")
    p.add_argument("--gpu_mem_gib", type=float, default=139.7, help="default: an H200")
    p.add_argument("--host_mem_gib", type=float, default=125.0, help="per host")
    p.add_argument("--ds_config", default=None,
                   help="a DeepSpeed JSON: its ZeRO stage and optimizer precision/offload are used as given "
                        "(default: ZeRO-3, and the planner picks the optimizer states)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--fastest", action="store_true",
                   help="with a command (-- <flags>): search SP size, levers, checkpointed layers and micro-batch "
                        "for the least time per sequence that fits on --gpus, and print the fastest plans")
    p.add_argument("--constants", default=None, metavar="FILE",
                   help="the time model's constants (a --calibrate file); default: the H200's")
    p.add_argument("--use_peft", action="store_true",
                   help="plan LoRA (PEFT) on the frozen model: the adapters' flags below as launch/train.py takes them")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_target_modules", default="all-linear")
    p.add_argument("--lora_modules_to_save", default=None)
    p.add_argument("--load_in_4bit", action="store_true", help="with --use_peft: the frozen base in NF4 (QLoRA)")
    p.add_argument("--calibrate", default=None, metavar="FILE",
                   help="measure this machine's constants (matmul, attention kernel, host copies; all-to-all under "
                        "torchrun) into FILE, and exit")
    return p


def _main(argv=None) -> int:
    from ..model.build import load_model_config

    argv = list(sys.argv[1:] if argv is None else argv)
    train_argv = None
    if "--" in argv:  # a command: the flags of launch/train.py after the planner's own (tools/plan_command.py)
        argv, train_argv = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    p = _parser()
    a = p.parse_args(argv)
    if a.calibrate:
        from .calibrate import calibrate

        calibrate(a.calibrate)
        return 0
    if train_argv is not None:
        from . import plan_command

        if a.ring_size != "auto":
            p.error("with a command, give --ring_size among its flags (after --)")
        a.seq_len, a.ring_size = a.seq_len or 1, None  # the command gives the length and the ring
        check_numbers(a)
        return plan_command.main(a, train_argv)
    if a.fastest:
        p.error("--fastest plans a command: give the flags of launch/train.py after --")
    if not a.longest and a.seq_len is None:
        p.error("give --seq_len N, or --longest (or a command after --)")
    a.ring_size = None if a.ring_size == "auto" else ring_size_number(a.ring_size)
    check_numbers(a)
    config = load_model_config(a.model, a.model_config, a.num_layers)
    g = geometry(config)
    if a.use_peft or a.load_in_4bit:
        from ..model.adapters import AdapterSpec, adapter_geometry, _names

        if not a.use_peft:
            raise ConfigError("--load_in_4bit plans QLoRA: add --use_peft")
        spec = AdapterSpec(r=a.lora_r, target_modules=_names(a.lora_target_modules) or ("all-linear",),
                           modules_to_save=_names(a.lora_modules_to_save), load_in_4bit=a.load_in_4bit)
        g["adapters"] = adapter_geometry(config, spec)
    if a.sp_size:
        check_heads(a.sp_size, g["heads"], g["kv"],
                    a.ring_size or resolve_ring_size("auto", a.sp_size, g["heads"], g["kv"]))
    sizes = sp_plans(g, a.gpus, a.sp_size, a.ring_size)
    ds_choices = ds_config_choices(a.ds_config) if a.ds_config else None
    if a.longest:
        a.seq_len = longest_fit(g, a.gpus, sizes, a.gpu_mem_gib * GiB, a.host_mem_gib * GiB, ds_choices)
        if not a.seq_len:
            print(f"nothing fits even at 8,192 tokens on {a.gpus} GPU(s) of {a.gpu_mem_gib} GiB")
            return 1
        print(f"longest sequence that fits: {a.seq_len:,} tokens")
    sp, levers, est, tried = plan(g, a.seq_len, a.gpus, sizes, a.gpu_mem_gib * GiB, a.host_mem_gib * GiB,
                                  ds_choices)
    return _report(a, g, ds_choices, sp, levers, est, tried)


def _report(a: argparse.Namespace, g: dict, ds_choices: Optional[dict], sp: Optional[int], levers: Optional[Levers],
            est: Optional[dict], tried: list) -> int:
    """Prints the plan (or why nothing fits) for the command line, as a table or with --json; the exit status."""
    if a.json:
        print(json.dumps({"sp_size": sp, "ring_size": est and est["ring_size"],
                          "levers": levers and levers.flags(a.ds_config), "estimate": est}, default=str))
        return 0 if sp else 1
    adapters = g.get("adapters")
    trained = (f" ({adapters['trainable'] / 1e6:.1f}M trained: LoRA r {adapters['rank']}"
               + (", 4-bit base" if adapters["quantized"] else "") + ")") if adapters else ""
    print(f"{g['params'] / 1e9:.2f}B params{trained}, {g['layers']} layers, {a.seq_len:,} tokens on {a.gpus} GPU(s)")
    print(default_flags(g, a.seq_len, a.gpus, a.sp_size, a.gpu_mem_gib * GiB, a.host_mem_gib * GiB, ds_choices,
                        a.ring_size))
    if sp is None:
        sp_last, lev_last, worst, _ = tried[-1]
        print(f"nothing fits: with every lever and --sp_size {sp_last}, {worst['gpu_total'] / GiB:.1f} GiB per GPU "
              f"(limit {a.gpu_mem_gib}) and {worst['host_total'] / GiB:.1f} GiB host (limit {a.host_mem_gib}):")
        print(_table(_gpu_rows(worst, lev_last)))
        print("use more GPUs, a shorter --seq_len, or fewer layers")
        return 1
    print(f"fits with --sp_size {sp}{ring_flag(est['ring_size'])} {levers.flags(a.ds_config)}  "
          f"({est['tokens_per_rank']:,} tokens per rank)")
    print(predicted_time(g, a.seq_len, a.gpus, sp, levers, ds_choices, a.constants))
    print("per GPU:")
    print(_table(_gpu_rows(est, levers) + [("CUDA overhead", CUDA_OVERHEAD), ("total (peak)", est["gpu_total"])]))
    print(f"  of {a.gpu_mem_gib:.0f} GiB\nper host:")
    print(_table(list(est["host"].items()) + [("total", est["host_total"])]))
    print("sent per sequence and rank:")
    print(_table(est["sent_per_sequence"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
