"""The memory estimate of one run, per GPU and per host: what the planner prints (tools/plan.py) and what
`--checkpoint_layers auto` asks through the lever policy (levers/policy.py), so that the trainer and the planner make
the same choice from the same numbers.

Per GPU and for the host it estimates model states (ZeRO stage, precision of the optimizer states, CPU offload),
the saved layer checkpoints (on the GPU, offloaded, or split between them, and one per segment of layers:
levers/placement.py), kept attention outputs, the working set of the layer being recomputed (attention, MLP tiled or
not), the loss, the all-to-all buffers and, with a ring, the K/V blocks in flight and their fp32 gradient
accumulators; and what each rank sends per step (all-to-all and ring point-to-point). The
formulas are in docs/memory.md with a comparison against the peaks measured on the H200."""

from __future__ import annotations

import math

from .layer_activations import kept_layer_bytes, uncheckpointed_backward_bytes
from .placement import layer_places
from .policy import GiB, Levers, checkpoint_bytes, kept_output_bytes, projection_bytes

# a 4-bit weight and its block's fp32 absmax (64 weights a block, no double quantization): --load_in_4bit's base
NF4_BYTES = 0.5 + 4 / 64
CUDA_OVERHEAD = 1.5 * GiB  # CUDA context, cuBLAS/cuDNN workspaces, allocator slack
# What a rank in an SP group holds beyond that for NCCL (its communicator's channel buffers, the all-to-all's and
# the ring's workspaces), and of the all-to-all's buffers: one set of q, k, v at a time, the received one (the sent
# copy is freed as the exchange returns). Fitted on the three SP=2 peaks of the H200 (131k tokens at 36 layers, 1M
# at 2 and 4 layers: -5.5%, +5.7%, +5.0% with both sets and no NCCL term; 0.0%, +0.4%, -0.2% now)
NCCL_GROUP_BYTES = 2.65 * GiB
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
# 4 units): the expanded path also held cuDNN's full-width gradient buffers. Models without GQA:
# ATTENTION_TENSORS_MHA.
ATTENTION_TENSORS_GQA = 7.5
# Our fused rotary (--fused_kernels) writes q and k rotated in one pass, without transformers' temporaries (q * cos,
# rotate_half's negated half and concatenation, the product with sin, and their gradients in the backward). Measured
# on the H200 at 131k tokens, where the attention block sets the peak: 44.99 -> 43.70 GiB with the kernels (FA4,
# tiled MLP), 1.29 units; 1.25 is used. The fused SwiGLU saves gate and
# up only, not silu(gate): one (tokens x intermediate) tensor less, 42.25 -> 41.06 GiB at 64k (MLP-bound), exactly it.
FUSED_ROTARY_SAVING = 1.25
# The block without GQA (as many KV heads as query heads: OLMo 3), nothing copied: measured on one H100 at 131k tokens
# with FA4, where the recomputed attention sets the peak (OLMo-3-7B at 16 layers, the tiled MLP: 45.7 GiB), at 6.5
# units; it keeps 64k's full-depth row within 1% too (67.4 GiB, the MLP's peak). Fewer than GQA's 7.5, measured on
# SDPA/cuDNN: FA4 keeps no full-width workspace of its own.
ATTENTION_TENSORS_MHA = 6.5
# The MLP's working set with the fused SwiGLU, in (tokens x intermediate) tensors: gate, up, the product and two
# gradients counted by hand (5); the untiled peaks measured where the MLP sets them come out at 5.5-5.8 (Qwen3-4B at
# 64k and 131k on the H200, Gemma-3-4B at 131k and OLMo-3-7B at 16 layers and 131k on an H100: -5.0 to -6.2% at 5,
# within 2% at 5.75): the allocator's rounding of such large blocks. Eager (6 tensors) the rows fit as counted.
MLP_TENSORS_FUSED = 5.75
# The recomputed Gated DeltaNet mixer (Qwen3.5, Qwen3-Next) at its own peak in the backward, in tokens x (2 key +
# value) tensors, beside the state of every chunk (`deltanet_bytes`). With our fused gated norm: 2.5, fitted on the
# one peak it sets (Qwen3.5-9B at 8 layers and 131k on one H100, the MLP tiled and the rule's outputs recomputed:
# 53.8 GiB). Without it, 2 more for the fp32 copies of the value width that transformers' gated norm makes: counted,
# not measured (no row runs it).
LINEAR_ATTENTION_TENSORS = 4.5
LINEAR_ATTENTION_TENSORS_FUSED = 2.5


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


def preference_loss_bytes(g: dict, t: int, loss_chunk: int = 4096, b: int = 2) -> int:
    """Our preference head's peak on one rank of `t` tokens (levers/preference_loss.py; tools/preference_plan.py
    plans its rows): the SFT fused loss's (our kernel) and the scored rows' hidden states and their gradient
    (2 x t x hidden), their log-probs, log-sum-exps and weights (fp64 sums)."""
    return loss_bytes(g, t, "ours", loss_chunk, b) + 2 * t * g["hidden"] * b + 24 * t


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


def deltanet_bytes(g: dict, t: int, b: int, fused: bool = False) -> float:
    """A recomputed Gated DeltaNet layer's mixer at its peak in the backward (LINEAR_ATTENTION_TENSORS, fewer with
    the fused gated norm: `fused`), and the state of every chunk of 64 tokens (value heads x key x value dim),
    recomputed in the backward with its gradient in fp32; 0 for a model without such layers."""
    d = g["linear_attn"]
    if not d:
        return 0
    units = LINEAR_ATTENTION_TENSORS_FUSED if fused else LINEAR_ATTENTION_TENSORS
    tensors = units * t * (d["conv_width"] + d["value_width"]) * b
    states = 2 * 4 * math.ceil(t / 64) * d["value_heads"] * d["key_head_dim"] * d["value_head_dim"]
    return tensors + states


def deltanet_saved_bytes(g: dict, t: int, b: int) -> int:
    """What a recomputed Gated DeltaNet layer's mixer holds for its own backward while the layer's MLP runs its
    backward first: FLA's q, k and v after the convolution (tokens x (2 key + value)). Beside an untiled MLP it sets
    the layer's peak: measured on one H100, Qwen3.5-9B at 8 layers and 131k tokens, 59.4 GiB with the MLP whole,
    53.8 with it tiled and the rule's outputs recomputed (1.0 GiB of the difference; docs/memory.md); 0 for a model
    without such layers."""
    d = g["linear_attn"]
    return t * d["conv_width"] * b if d else 0


def kept_in_flight(g: dict, t: int, b: int, levers: Levers) -> int:
    """What the offload holds on the host of one layer and returns to the GPU for that layer's backward (into its
    recompute), the largest layer's: its kept projection outputs (`--keep_projections`) and, in a Gated DeltaNet
    layer, the gated delta rule's kept outputs (`--linear_recompute never`: 1.0 GiB measured at 131k on
    Qwen3.5-9B, 1.5 counted). Both come back for the same layer, so they add up per layer, not across layers."""
    if not levers.offload_activations:
        return 0

    def one_layer(shape) -> int:
        kept = projection_bytes(g, shape, t, b) if levers.keep_projections else 0
        if levers.keep_linear and levers.checkpointing and not shape.span.attention:
            kept += kept_output_bytes(g, shape, t, b)
        return kept
    return max(one_layer(shape) for shape in g["layer_shapes"])


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


def checkpoint_split(g: dict, t: int, b: int, levers: Levers) -> dict:
    """Bytes one rank saves for the recompute, on the GPU and on the host, and how many layers hold each: a
    checkpoint (the layer's input) where a layer opens a segment, and with kept outputs those of every checkpointed
    layer (policy.kept_output_bytes), on the host for the layers levers/placement.py puts there."""
    places = layer_places(levers, g["layers"])
    one = checkpoint_bytes(g, t, b) / g["layers"]
    inputs = [i for i, p in enumerate(places) if p.checkpointed and p.saves_input]
    shapes = g["layer_shapes"]
    kept = {i: kept_output_bytes(g, shapes[i], t, b) for i, p in enumerate(places)
            if p.checkpointed and levers.keeps_outputs(shapes[i].span)}
    for i, p in enumerate(places):
        if p.keeps_projections:
            kept[i] = kept.get(i, 0) + projection_bytes(g, shapes[i], t, b)
    on_host = {i for i, p in enumerate(places) if p.on_host}
    host_inputs, host_kept = sum(i in on_host for i in inputs), sum(n for i, n in kept.items() if i in on_host)
    return {"gpu checkpoints": (len(inputs) - host_inputs) * one, "host checkpoints": host_inputs * one,
            "gpu kept": sum(kept.values()) - host_kept, "host kept": host_kept,
            "checkpoints": len(inputs), "on the host": host_inputs,
            "gpu layers": sum(p.checkpointed and not p.on_host for p in places)}


def estimate(g: dict, seq_len: int, gpus: int, sp: int, levers: Levers, loss_chunk: int = 4096,
             tile_tokens: int = 16384, zero_stage: int = 3, act_bytes: int = 2, ring: int = 1,
             pairs: bool = False) -> dict:
    """Bytes per GPU (and per host, for all local ranks' offloads) of each component; `ring`: --ring_size (sp is
    then Ulysses sp / ring x ring); `pairs`: preference training's head (preference_loss_bytes)."""
    t = math.ceil(seq_len / sp)  # tokens per rank
    ulysses = sp // ring
    b = act_bytes
    # ZeRO partitions optimizer states from stage 1, gradients from stage 2, weights at stage 3, over all GPUs
    w_div, g_div, o_div = (gpus if zero_stage >= k else 1 for k in (3, 2, 1))
    gpu_states, host_states = model_state_bytes(g, levers, w_div, g_div, o_div)
    gathered = gathered_layer_bytes(g) if zero_stage == 3 else 0
    n_ckpt = min(levers.checkpointed(g["layers"]), g["layers"])
    saved = checkpoint_split(g, t, b, levers)
    # the other layers keep their activations (the last ones: freed by their backward before any recompute starts)
    unchecked = [g["attn_spans"][i] for i in range(n_ckpt, g["layers"])]
    whole_layers = sum(kept_layer_bytes(g, t, b, levers, sp, span) for span in unchecked)
    # the recomputed layer's attention block at its peak, and the fp32 input copies of transformers' norms
    norm_copies = 0 if levers.lean_norm else 4 * t * (g["hidden"] + (g["attn_width"] + g["kv_width"]) * g["qk_norm"])
    units = (ATTENTION_TENSORS if not levers.gqa_native else ATTENTION_TENSORS_GQA if g["kv"] < g["heads"]
             else ATTENTION_TENSORS_MHA)
    units -= FUSED_ROTARY_SAVING if levers.fused_kernels else 0
    attention = units * t * g["attn_width"] * b + norm_copies
    mlp_rows = min(t, tile_tokens) if levers.tiled_mlp else t
    # gate, up, act, product + two gradients; the fused SwiGLU keeps no act
    mlp = (MLP_TENSORS_FUSED if levers.fused_kernels else 6) * mlp_rows * g["inter"] * b
    hidden_acts = 8 * t * g["hidden"] * b  # norms, residuals, projections' outputs and their gradients
    # with segments, the inputs the regenerating forward made for the segment's other layers, held at once
    regenerated = (min(levers.checkpoint_every, max(n_ckpt, 1)) - 1) * t * g["hidden"] * b if levers.checkpointing \
        else 0
    # a DeltaNet layer's MLP runs its backward with the mixer's saved q, k, v beside it; the mixer's own peak after
    mixer = max(mlp + deltanet_saved_bytes(g, t, b), deltanet_bytes(g, t, b, levers.fused_kernels))
    layer = hidden_acts + max(attention, mlp, mixer) + regenerated + kept_in_flight(g, t, b, levers)
    loss = loss_bytes(g, t, levers.loss_kernel, loss_chunk, b)
    if pairs:
        loss = preference_loss_bytes(g, t, loss_chunk, b)
    a2a = t * (g["attn_width"] + 2 * max(g["kv_width"], g["head_dim"] * ulysses)) * b if ulysses > 1 else 0
    ring_buffers = ring_bytes(g, t, sp, ring, b)
    on_gpu_ckpt, on_gpu_kept = saved["gpu checkpoints"], saved["gpu kept"]
    gpu = {"model states": gpu_states + gathered, "checkpoints": on_gpu_ckpt, "kept outputs": on_gpu_kept,
           "layer working set": layer, "loss": loss, "all-to-all buffers": a2a}
    if regenerated:
        gpu["regenerated inputs"] = regenerated  # part of the layer working set
    if ring > 1:
        gpu["ring buffers"] = ring_buffers
    nccl = NCCL_GROUP_BYTES if sp > 1 else 0
    if nccl:
        gpu["NCCL buffers"] = nccl
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
    gpu_total = gpu["model states"] + on_gpu_ckpt + on_gpu_kept + transient + nccl + CUDA_OVERHEAD
    ranks_per_host = min(gpus, 8)
    host = {"optimizer offload": host_states * ranks_per_host,
            "offloaded checkpoints": (saved["host checkpoints"] + saved["host kept"]) * ranks_per_host}
    return {"tokens_per_rank": t, "ring_size": ring, "gpu": gpu, "checkpoint_split": saved, "gpu_total": gpu_total,
            "host": host, "host_total": sum(host.values()) + 4 * GiB * ranks_per_host,
            "sent_per_sequence": communication(g, seq_len, sp, ring, levers, b)}


def fits(est: dict, gpu_mem: float, host_mem: float, share: float = 0.95, host: bool = True,
         host_share: float = 1.0) -> bool:
    """Whether an estimate fits: within `share` of the GPU's memory (the rest for what the estimate misses) and
    (unless `host` is False: the GPU alone) within `host_share` of the host's."""
    return est["gpu_total"] <= share * gpu_mem and (not host or est["host_total"] <= host_share * host_mem)


def estimate_on(g: dict, seq_len: int, gpus: int, sp: int, zero_stage: int = 3, micro: int = 1, act_bytes: int = 2,
                **run):
    """This run's estimate as a function of its levers. `run`: estimate's other settings of the run (loss_chunk,
    tile_tokens, ring, pairs)."""
    return lambda levers: estimate(g, micro * seq_len, gpus, sp, levers, zero_stage=zero_stage, act_bytes=act_bytes,
                                   **run)


def fits_with(estimate_of, gpu_mem: float, host_mem: float):
    """Whether given levers fit this machine by `estimate_of` (estimate_on), within a share of the GPU: what
    `--checkpoint_layers auto`, `--attn_recompute auto` and `--tiled_mlp auto` ask (the trainer and the planner pass
    it to the policy)."""
    def fits_levers(levers: Levers, share: float = 0.95, host: bool = True, host_share: float = 1.0) -> bool:
        return fits(estimate_of(levers), gpu_mem, host_mem, share, host, host_share)
    return fits_levers


def fits_on(g: dict, seq_len: int, gpus: int, sp: int, gpu_mem: float, host_mem: float, zero_stage: int = 3,
            micro: int = 1, act_bytes: int = 2, **run):
    """fits_with the estimate of this run (estimate_on's arguments)."""
    return fits_with(estimate_on(g, seq_len, gpus, sp, zero_stage, micro, act_bytes, **run), gpu_mem, host_mem)
