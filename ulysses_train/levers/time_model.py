"""Step-time model: what one optimizer step of a run takes, part by part, from the model's geometry, the levers, the
parallel layout and a machine's constants.

Per decoder layer and rank (T tokens on the rank, S the whole sequence, sp ranks sharing it):

    forward     linear layers 2 T x params at the matmul rate; attention 4 x (query-key pairs) x heads x head_dim / sp
                at the kernel's forward rate, the pairs per document: doc^2 / 2 for full causal attention, for a
                sliding window w the exact sum of min(t + 1, w) over positions t (FA4: the pairs of its whole tiles,
                at its window share of the rate), for chunked attention doc^2 / 2 per chunk; heads wider than 128
                at the kernel's wide-head share; a Gated DeltaNet layer's recurrence linear in T (FLA's chunked
                FLOPs at a fitted rate) and its work around it (the conv, copies, gates) per token and channel;
                norms, rotary, SwiGLU and the gated norm per token and width (fused or eager rates); residual adds
                at HBM bandwidth; the Ulysses all-to-all of q, k, v and the output (sp > 1)
    recompute   a checkpointed layer runs its forward again before its backward, without the attention kernel when
                its outputs are kept (`--attn_recompute never`; a DeltaNet layer's recurrence likewise where its
                outputs are kept, `Levers.keep_linear`); an
                uncheckpointed layer (`--checkpoint_layers`) not at all
    backward    twice the linear FLOPs, 2.5x the attention (and DeltaNet) FLOPs at the backward rate, the elementwise
                backward, the all-to-all again; the tiled MLP runs its MLP forward once more
    overlapped  the offload's copies (PCIe, side streams) and ZeRO-3's gathers and reduce-scatters (prefetched on
                their own stream) cost only what they take beyond the layer's compute

and per step the fused loss (6 x T x vocab x hidden at the loss rate), the optimizer (DeepSpeed's fused Adam on the
GPU at HBM speed, or its CPU Adam on the host's cores) and a fixed overhead. attention_pairs.py counts the
query-key pairs.

Under --use_peft (`g["adapters"]`, model/adapters.py) a frozen weight has no gradient: the backward of a frozen
linear layer is its input's gradient alone (once, not twice, its forward's FLOPs), a frozen LM head costs the loss 4
instead of 6 x T x vocab x hidden, the optimizer steps the trainable parameters only and ZeRO-3 reduce-scatters
only their gradients; the adapters add their own work, counted at HBM speed since a rank-r product is bound by
reading and writing its activations (`_lora_seconds`). Not measured against a GPU yet. The all-to-all runs on the
compute stream and is not overlapped. Rates and bandwidths are `Constants` (machine_constants.py): H200 defaults
fitted to the steps measured in docs/results (benchmarks/time_vs_measured.py prints the comparison; docs/time.md
has it), or measured on the current machine by `python -m ulysses_train.plan --calibrate FILE` (tools/calibrate.py).

It sits beside the memory estimate (memory.py) because the lever policy decides by both (`seconds_on`). A `shape`
here is a layer's LayerShape, a `span` its mixer's Span (model/geometry.py, a layer above: their fields are read,
the module is not imported).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from ..families import FAMILIES
from ..sp.fa4_op import cudnn_backward_is_faster
from ..sp.gated_delta_op import CHUNK as FLA_CHUNK  # the chunk of FLA's gated delta rule
from .attention_pairs import causal_pairs, chunk_pieces, fa4_tiles, kernel_window_pairs
from .machine_constants import KERNELS, Constants
from .memory import NF4_BYTES
from .placement import LayerPlace, layer_places
from .policy import Levers, kept_output_bytes, projection_bytes, projection_features

__all__ = ["KERNELS", "Constants", "Run", "forward_time", "optimizer_seconds", "seconds_on", "step_time"]


@dataclass(frozen=True)
class Run:
    """One run as the model sees it."""

    g: dict  # model/geometry.py
    seq_len: int
    gpus: int
    sp: int
    levers: Levers
    kernel: str = "flash_attn_4"  # the attention kernel that runs (not `auto`)
    micro: int = 1  # sequences per SP group per micro-step
    accum: int = 1  # micro-steps per optimizer step
    zero_stage: int = 3
    docs: Optional[tuple] = None  # per sequence of a micro-batch, its packed documents' lengths; None: one each
    act_bytes: int = 2


def _documents(run: Run) -> tuple:
    """Per sequence of the micro-batch, its documents' lengths."""
    return run.docs or tuple((run.seq_len,) for _ in range(run.micro))


def _window_pairs(n: int, span, run: Run, shape, backward: bool) -> float:
    """Query-key pairs of one document in one pass of a layer: FA4's tile-granular count for a window (its SM90
    tiles, `fa4_tiles`; the forward's query rows shared by the heads of a KV head), the exact count otherwise."""
    if span.kind != "window" or run.kernel != "flash_attn_4":
        return causal_pairs(n, span)
    (fr, fc), (br, bc) = fa4_tiles(shape.head_dim)
    if backward:
        return kernel_window_pairs(n, span.size, br, bc)
    pack = max(1, shape.heads // max(shape.kv, 1))
    return kernel_window_pairs(n, span.size, max(1, fr // pack), fc)


def _attention_flops(run: Run, shape, backward: bool = False) -> float:
    """Forward FLOPs of one layer's attention on one rank (`backward`: over the pairs the backward's tiles cover,
    still counted as forward FLOPs): the score and value products, 2 FLOPs each per query-key pair and unit of
    width (the layer's heads x head_dim), for its heads/sp over every sequence of the batch."""
    span, pairs = shape.span, 0.0
    for lengths in _documents(run):
        pieces = chunk_pieces(lengths, span.size) if span.kind == "chunk" else lengths
        pairs += sum(_window_pairs(n, span, run, shape, backward) for n in pieces)
    return 4 * pairs * shape.attn_width / run.sp


def _deltanet_flops(run: Run) -> float:
    """Forward FLOPs of one Gated DeltaNet layer's recurrence on one rank (its projections count as linear layers,
    the conv and the rest as its elementwise work). Per token and value head the chunked delta rule reads, corrects
    and updates the head's state (key x value dim: three products, 6 dk dv) and meets the rest of its chunk (the
    causal half of the chunk's q k^T, k k^T and attention x v: chunk x (2 dk + dv)). Counted from the algorithm,
    not from a kernel: linear in the tokens, at the rate fitted on FLA's."""
    d = run.g["linear_attn"]
    dk, dv = d["key_head_dim"], d["value_head_dim"]
    per_head = 6 * dk * dv + FLA_CHUNK * (2 * dk + dv)  # each token meets the rest of its chunk directly
    per_token = d["value_heads"] * per_head
    return per_token * sum(sum(lengths) for lengths in _documents(run)) / run.sp


def _collective_gb_s(ranks: int, c: Constants) -> float:
    """What each rank moves per second in a collective over `ranks` GPUs: NVLink inside a node, the network past it."""
    return c.nvlink_gb_s if ranks <= c.gpus_per_node else c.network_gb_s


@dataclass(frozen=True)
class _Pass:
    """Seconds of one layer's work on one rank, per pass: what the forward, the recompute and the backward add up."""

    linear_fwd: float  # the linear layers' forward (the backward is twice it)
    mlp_fwd: float  # its MLP part (the tiled MLP runs it once more in the backward)
    attn_fwd: float
    attn_bwd: float
    elem_fwd: float  # norms, rotary, SwiGLU, residual adds and copies
    elem_bwd: float
    swiglu_fwd: float  # its SwiGLU part
    a2a: float  # the Ulysses all-to-all of one pass, with its layout copies
    linear_bwd: float = 0.0  # the linear layers' backward: twice the forward, once for frozen weights
    lora_fwd: float = 0.0  # the adapters (--use_peft), forward and backward
    lora_bwd: float = 0.0


def _elementwise(run: Run, c: Constants, t: int, moe: bool, deltanet: Optional[dict] = None
                 ) -> tuple[float, float, float]:
    """(forward, backward, SwiGLU forward) seconds of a layer's elementwise ops: our fused kernels replace the norms
    and rotary everywhere and the SwiGLU of dense MLPs; the eager ops run at `eager_in_step` of their cost alone. A
    DeltaNet layer (`deltanet`: geometry's linear_attn dims) adds its gated output norm (value width: a norm and a
    gated product, fused with the kernels) and its work around the recurrence (`deltanet_elementwise`)."""
    g, lv, b = run.g, run.levers, run.act_bytes
    eager = dataclasses.replace(c.eager, **{k: v * c.eager_in_step for k, v in dataclasses.asdict(c.eager).items()})
    norm, rot, swi = (c.fused, c.fused, eager if moe else c.fused) if lv.fused_kernels else (eager,) * 3
    gated = c.fused if lv.fused_kernels else eager
    gated_norm_w = 0 if deltanet is None else deltanet["value_heads"] * deltanet["value_head_dim"]
    around = 0.0 if deltanet is None else t * deltanet["conv_width"] * c.deltanet_elementwise
    # the hidden-width norms (two; four in Gemma) and the q, k norms (Qwen3, Gemma 3/4, OLMo 3)
    norm_w = g["norms"] * g["hidden"] + (g["attn_width"] + g["kv_width"]) * g["qk_norm"]
    rot_w, swi_w = g["attn_width"] + g["kv_width"], g["inter"]
    copies = 6 * t * g["hidden"] * b  # two residual adds: read two H-wide tensors, write one
    if not lv.gqa_native:  # k and v copied to every query head, and their gradients summed back
        copies += 2 * t * (g["attn_width"] - g["kv_width"]) * b
    if moe:  # each token's hidden state gathered for its experts and their outputs added back
        copies += 2 * t * g["experts_per_token"] * g["hidden"] * b
    copy_s = copies / (c.hbm_tb_s * 1e12)
    fwd = t * (norm_w * norm.norm_fwd + rot_w * rot.rotary_fwd + swi_w * swi.swiglu_fwd
               + gated_norm_w * (gated.norm_fwd + gated.swiglu_fwd)) + copy_s + around
    bwd = t * (norm_w * norm.norm_bwd + rot_w * rot.rotary_bwd + swi_w * swi.swiglu_bwd
               + gated_norm_w * (gated.norm_bwd + gated.swiglu_bwd)) + copy_s + 2 * around
    return fwd, bwd, t * swi_w * swi.swiglu_fwd


def _mixer_seconds(run: Run, c: Constants, shape) -> tuple[float, float]:
    """(forward, backward) seconds of a layer's token mixer: its attention kernel over the layer's span (a window at
    the kernel's window share, heads past 128 at its wide-head share), or the DeltaNet recurrence; the backward 2.5
    times the forward's FLOPs (measured for attention, assumed for DeltaNet)."""
    if not shape.span.attention:
        flops, rate = _deltanet_flops(run), c.linear_attention_tflops * 1e12
        return flops / rate, 2.5 * flops / rate
    rates = c.attention[run.kernel]
    share = (rates.window if shape.span.kind == "window" else 1.0) * (rates.wide_heads if shape.head_dim > 128
                                                                      else 1.0)
    back, back_share = rates, share
    cudnn = c.attention.get("sdpa")
    if run.kernel == "flash_attn_4" and cudnn is not None and _cudnn_backward(run, shape):  # our op runs cuDNN's
        back, back_share = cudnn, cudnn.wide_heads if shape.head_dim > 128 else 1.0
    fwd, bwd = _attention_flops(run, shape), _attention_flops(run, shape, backward=True)
    return fwd / (rates.fwd * share * 1e12), 2.5 * bwd / (back.bwd * back_share * 1e12)


def _cudnn_backward(run: Run, shape) -> bool:
    """Whether our FA4 op hands this layer's backward to cuDNN (sp/fa4_op.py), on the Hopper GPUs the constants
    describe: full causal attention at head_dim 256 without a softcap or sinks, unpacked (packed documents go
    through FA4's varlen op, whose backward is FA4's own)."""
    if run.docs is not None:
        return False
    family = FAMILIES.get(run.g["model_type"])
    softcap = family is not None and family.attention_softcap
    sinks = family is not None and family.sinks
    return cudnn_backward_is_faster(shape.head_dim, shape.head_dim, shape.span.kind == "full", -1,
                                    1.0 if softcap else 0.0, sinks, (9, 0))


def _pass(run: Run, c: Constants, shape) -> _Pass:
    b = run.act_bytes
    t = run.micro * math.ceil(run.seq_len / run.sp)
    rate = c.matmul_tflops * 1e12
    mlp_fwd = 2 * t * shape.mlp_matmul_params / (rate * (c.moe_matmul_efficiency if shape.moe else 1.0))
    linear_fwd = 2 * t * (shape.matmul_params - shape.mlp_matmul_params) / rate + mlp_fwd
    attn_fwd, attn_bwd = _mixer_seconds(run, c, shape)
    deltanet = None if shape.span.attention else run.g["linear_attn"]
    elem_fwd, elem_bwd, swiglu_fwd = _elementwise(run, c, t, shape.moe, deltanet)
    adapters = run.g.get("adapters")
    trained = 1.0 - adapters["frozen_matmul"] / max(adapters["matmul"], 1) if adapters else 1.0
    linear_bwd = (1 + trained) * linear_fwd  # the input's gradient, and the weight's where it is trained
    lora_fwd, lora_bwd = _lora_seconds(run, c, t)
    a2a = 0.0
    if run.sp > 1 and shape.span.attention:  # q, k, v (KV heads replicated up to sp) out, the output back
        sent = t * (2 * shape.attn_width + 2 * max(shape.kv, run.sp) * shape.head_dim) * b
        a2a = sent * (run.sp - 1) / run.sp / (_a2a_gb_s(run, c) * 1e9) + 2 * sent / (c.hbm_tb_s * 1e12)
    return _Pass(linear_fwd, mlp_fwd, attn_fwd, attn_bwd, elem_fwd, elem_bwd, swiglu_fwd, a2a, linear_bwd, lora_fwd,
                 lora_bwd)


def _lora_seconds(run: Run, c: Constants, t: int) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's adapters on `t` tokens: per LoRA'd linear (in -> out) the forward
    reads its input for A, writes B's output and adds it to the base's (in + 3 out elements a token); the backward
    reads the output's gradient for B and for B's gradient, the input again for A's gradient, and adds its share of
    the input's gradient (2 out + 4 in); the rank-r matmuls' FLOPs (2 r (in + out) a token, twice that backward) at
    the matmul rate. A MoE's experts (PEFT's ParamWrapper) get B A added to their whole weights in each forward and
    its gradient taken in the backward: three weight-sized passes each way. 0 without adapters."""
    adapters = run.g.get("adapters")
    if not adapters:
        return 0.0, 0.0
    lin, lout, r, b = adapters["lora_in"], adapters["lora_out"], adapters["rank"], run.act_bytes
    flops = 2 * t * r * (lin + lout) / (c.matmul_tflops * 1e12)
    hbm = c.hbm_tb_s * 1e12
    experts = 3 * adapters.get("expert_weights", 0) * b / hbm
    return t * (lin + 3 * lout) * b / hbm + flops + experts, t * (4 * lin + 2 * lout) * b / hbm + 2 * flops + experts


def _layer(run: Run, c: Constants, shape, checkpointed: bool, place: Optional[LayerPlace] = None) -> dict:
    """Seconds of one decoder layer on one rank: compute per part, and the wall time of its forward and backward with
    the overlapped copies and collectives; `place` (levers/placement.py): where its checkpoint is, and whether it
    runs a regenerating forward (default: every checkpointed layer saves its input, offloaded with the offload)."""
    g, lv, p = run.g, run.levers, _pass(run, c, shape)
    place = place or LayerPlace(checkpointed, on_host=lv.offload_activations and checkpointed)
    tiled = lv.tiled_mlp and not g["experts"]  # the tiled MLP runs its forward again in the backward
    keep = lv.keeps_outputs(shape.span)
    # the projections' matmuls this layer's recompute skips (--keep_projections: the first layers)
    skipped = _projection_seconds(run, c, shape) if place.keeps_projections else 0.0
    forward = p.linear_fwd + p.lora_fwd + p.attn_fwd + p.elem_fwd + p.a2a
    recompute = (p.linear_fwd - skipped + p.lora_fwd + (0 if keep else p.attn_fwd) + p.elem_fwd + p.a2a
                 if checkpointed else 0)
    backward = p.linear_bwd + p.lora_bwd + p.attn_bwd + p.elem_bwd + p.a2a + ((p.mlp_fwd + p.swiglu_fwd) if tiled
                                                                             else 0)
    # overlapped: the offload's copies of a checkpointed layer's input and kept outputs (out in the forward, back in
    # the backward); ZeRO-3's gathers (forward, recompute, backward) and the gradients' reduce-scatter
    host = _host_copy_seconds(run, c, shape, place, keep)
    share = 2 * shape.params * (run.gpus - 1) / run.gpus / (_collective_gb_s(run.gpus, c) * 1e9)
    gathered, reduced = _zero3_shares(g)
    gather = share * gathered if run.zero_stage == 3 else 0.0
    reduce = share * reduced if run.zero_stage >= 2 else 0.0
    mixer = "attention" if shape.span.attention else "linear attention"
    parts = {"adapters": (p.lora_fwd * (2 if checkpointed else 1) + p.lora_bwd)} if g.get("adapters") else {}
    return {**parts, "matmul": p.linear_fwd * (2 if checkpointed else 1) - skipped + p.linear_bwd
            + (p.mlp_fwd if tiled else 0),
            mixer: p.attn_fwd * (2 if checkpointed and not keep else 1) + p.attn_bwd,
            "elementwise": p.elem_fwd * (2 if checkpointed else 1) + p.elem_bwd + (p.swiglu_fwd if tiled else 0),
            "all-to-all": p.a2a * (3 if checkpointed else 2),
            "forward": max(forward, host, gather),
            "backward": max(recompute + backward, host, gather * (2 if checkpointed else 1) + reduce),
            "host copies": 2 * host, "zero-3": gather * (3 if checkpointed else 2) + reduce,
            **({"regenerate": _regenerate_seconds(p)} if place.regenerates else {})}


def _projection_seconds(run: Run, c: Constants, shape) -> float:
    """The forward matmuls of the projections a layer keeps (policy.projection_features), at the matmul rate: what
    its recompute skips under `--keep_projections`."""
    t = run.micro * math.ceil(run.seq_len / run.sp)
    return 2 * t * sum(i * o for i, o in projection_features(run.g, shape)) / (c.matmul_tflops * 1e12)


def _host_copy_seconds(run: Run, c: Constants, shape, place: LayerPlace, keep: bool) -> float:
    """Seconds of one direction of a layer's offload copies (PCIe per GPU, or its share of the host's bandwidth):
    its input where it holds a checkpoint, and its kept mixer outputs (policy.kept_output_bytes); 0 for a layer
    whose checkpoint stays on the GPU (`--gpu_checkpoints`). A segment's first layer on the host has its input
    brought back for the regenerating forward by the same prefetch that brings it back for its own recompute: no
    second copy."""
    if not (place.checkpointed and place.on_host):
        return 0.0
    g, b = run.g, run.act_bytes
    t = run.micro * math.ceil(run.seq_len / run.sp)
    per_gpu = min(c.pcie_gb_s, c.host_gb_s / min(run.gpus, c.gpus_per_node)) * 1e9
    saved = (t * g["hidden"] * b if place.saves_input else 0) + (kept_output_bytes(g, shape, t, b) if keep else 0)
    saved += projection_bytes(g, shape, t, b) if place.keeps_projections else 0
    return saved / per_gpu


def _regenerate_seconds(p: _Pass) -> float:
    """The forward a layer runs once more in the backward to regenerate the next layer's input in its segment
    (`--checkpoint_every`): the whole forward, the attention kernel included (it runs without a gradient and
    without the kept outputs), on the compute stream."""
    return p.linear_fwd + p.lora_fwd + p.attn_fwd + p.elem_fwd + p.a2a


def _add_regeneration(layer: dict, p: _Pass, mixer: str) -> dict:
    """A layer's seconds with its regenerating forward booked: per part, and in the backward's wall time."""
    if "regenerate" not in layer:
        return layer
    out = dict(layer)
    for part, seconds in (("matmul", p.linear_fwd), (mixer, p.attn_fwd), ("elementwise", p.elem_fwd),
                          ("all-to-all", p.a2a), ("adapters", p.lora_fwd)):
        if part in out:
            out[part] += seconds
    out["backward"] += out.pop("regenerate")
    return out


def _zero3_shares(g: dict) -> tuple[float, float]:
    """What ZeRO-3 moves of a layer against full fine-tuning: (gathered weights, reduce-scattered gradients). Under
    --use_peft only the trainable parameters' gradients are reduced, and NF4 weights gather at about a quarter of
    bf16's bytes."""
    adapters = g.get("adapters")
    if not adapters:
        return 1.0, 1.0
    quantized = adapters["quantized"] / max(g["params"], 1)
    gathered = 1.0 - quantized + quantized * NF4_BYTES / 2
    return gathered, adapters["trainable"] / max(g["params"], 1)


def _a2a_gb_s(run: Run, c: Constants) -> float:
    """The all-to-all's rate per rank: NVLink while the SP group stays in a node; past it, the share of each rank's
    data that crosses the network sets the pace."""
    if run.sp <= c.gpus_per_node:
        return c.nvlink_gb_s
    off_node = (run.sp - c.gpus_per_node) / (run.sp - 1)  # of the data a rank sends, the part to other nodes
    return min(c.nvlink_gb_s / (1 - off_node), c.network_gb_s / off_node)


def optimizer_seconds(run: Run, c: Constants) -> float:
    """The optimizer step of one rank: its partition of the parameters (ZeRO partitions the states over all GPUs)."""
    lv, params = run.levers, run.g["params"]
    if run.g.get("adapters"):  # --use_peft: only the trainable parameters have optimizer states
        params = run.g["adapters"]["trainable"]
    share = params / run.gpus if run.zero_stage >= 1 else params
    if lv.offload_optimizer:  # the host's cores run every local rank's partition; gradients down, weights up
        ranks_per_host = min(run.gpus, c.gpus_per_node)
        return share * ranks_per_host / c.cpu_adam_params_per_s + share * 4 / (c.pcie_gb_s * 1e9)
    state_bytes = 14 if lv.bf16_states else 28
    return share * state_bytes / (c.adam_gb_s * 1e9)


def step_time(run: Run, c: Constants = Constants()) -> dict:
    """Seconds of one optimizer step: `total`, and per part (compute seconds of each kind; `exposed` copies and
    collectives, what they add beyond the compute they overlap)."""
    g, lv = run.g, run.levers
    # the first checkpointed layers (levers/placement.py: where each one's checkpoint is); alike layers counted once
    places = layer_places(lv, g["layers"])
    kinds = Counter(zip(g["layer_shapes"], places))
    layers = [(count, _regenerating_layer(run, c, shape, place)) for (shape, place), count in kinds.items()]
    t = run.micro * math.ceil(run.seq_len / run.sp)
    loss_tflops = c.liger_loss_tflops if lv.loss_kernel == "liger" else c.loss_tflops
    adapters = g.get("adapters")
    # logits, the hidden states' gradient and (unless the head is frozen) the head's
    head_products = 2 if adapters and not (adapters["head_trainable"] or adapters["head_lora"]) else 3
    loss = 2 * head_products * t * g["vocab"] * g["hidden"] / (loss_tflops * 1e12)
    parts = {k: 0.0 for k in ("matmul", "attention", "elementwise", "all-to-all")}
    if adapters:
        parts["adapters"] = 0.0
    if g["linear_attn"]:
        parts["linear attention"] = 0.0
    wall = loss
    hidden_comm = {"host copies": 0.0, "zero-3": 0.0}
    for count, layer in layers:
        for k in parts:
            parts[k] += count * layer.get(k, 0.0)
        for k in hidden_comm:
            hidden_comm[k] += count * layer[k]
        wall += count * (layer["forward"] + layer["backward"])
    wall += _first_fetch_seconds(run, c, places)
    compute = sum(parts.values()) + loss
    parts["loss"] = loss
    micro_step = wall
    parts = {k: v * run.accum for k, v in parts.items()}
    parts["exposed copies and collectives"] = max(0.0, micro_step - compute) * run.accum
    parts["optimizer"] = optimizer_seconds(run, c)
    parts["overhead"] = c.step_overhead_s
    total = micro_step * run.accum + parts["optimizer"] + parts["overhead"]
    communication = parts["all-to-all"] + parts["exposed copies and collectives"]
    return {"total": total, "parts": parts, "communication_share": communication / total,
            "overlapped": {k: v * run.accum for k, v in hidden_comm.items()}}


def _first_fetch_seconds(run: Run, c: Constants, places: list) -> float:
    """The copy back of the first layer the backward meets with its saved tensors on the host (the last one): the
    offload fetches a layer's tensors when the backward first asks for one of them and the next layer's beside them
    (offload.py), so this layer's come back while the compute stream waits. Every later layer's copy overlaps the
    layer before it."""
    on_host = [i for i, place in enumerate(places) if place.checkpointed and place.on_host]
    if not on_host:
        return 0.0
    shape = run.g["layer_shapes"][on_host[-1]]
    return _host_copy_seconds(run, c, shape, places[on_host[-1]], run.levers.keeps_outputs(shape.span))


def seconds_on(g: dict, seq_len: int, gpus: int, sp: int, zero_stage: int = 3, micro: int = 1, act_bytes: int = 2,
               c: Constants = Constants()):
    """This run's step time (step_time's total, FlashAttention-4) as a function of its levers: what the lever policy
    compares candidates by (levers/policy.py: `--keep_projections auto`)."""
    return lambda levers: step_time(Run(g, seq_len, gpus, sp, levers, micro=micro, zero_stage=zero_stage,
                                        act_bytes=act_bytes), c)["total"]


def _regenerating_layer(run: Run, c: Constants, shape, place: LayerPlace) -> dict:
    """`_layer` of a layer in its place, its regenerating forward (if any) booked."""
    mixer = "attention" if shape.span.attention else "linear attention"
    layer = _layer(run, c, shape, place.checkpointed, place)
    if place.regenerates and place.saves_input and place.on_host and (run.levers.keep_attention
                                                                       or run.levers.keep_linear):
        # with kept outputs the offload's groups are per layer, and the prefetch has not reached the segment's
        # first input when its regenerating forward asks for it: that copy back is exposed
        layer["regenerate"] += _host_copy_seconds(run, c, shape, place, False)
    return _add_regeneration(layer, _pass(run, c, shape), mixer)


def forward_time(run: Run, c: Constants = Constants()) -> float:
    """Seconds of one micro-batch's forward alone on one rank, without a gradient (DPO's reference pass,
    train/preference/reference_logps.py): every layer once with its ZeRO-3 gather overlapped, and the head's log-probs
    (2 x T x vocabulary x hidden at our loss's rate)."""
    g = run.g
    t = run.micro * math.ceil(run.seq_len / run.sp)
    total = 2 * t * g["vocab"] * g["hidden"] / (c.loss_tflops * 1e12)
    for shape in g["layer_shapes"]:
        p = _pass(run, c, shape)
        gather = 0.0
        if run.zero_stage == 3:
            gather = 2 * shape.params * (run.gpus - 1) / run.gpus / (_collective_gb_s(run.gpus, c) * 1e9)
        total += max(p.linear_fwd + p.attn_fwd + p.elem_fwd + p.a2a, gather)
    return total
