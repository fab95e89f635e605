"""The lever policy: the flags, the model's geometry and the device in, one resolved `Levers` out.

The trainer and the planner (tools/plan.py) both call `resolve_levers`, so the plan describes the run the trainer
makes, and every `auto` decision lives here, with the reason it was taken. Model surgery (model/surgery.py) may
still turn an `auto` lever off when it matches no module of the model, and says so.

    request (flags) + geometry + tokens per rank + device + DeepSpeed choices  ->  Levers (+ why)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..errors import ConfigError
from ..families import record_of
from ..sp.gated_delta_op import CHUNK as FLA_CHUNK  # a kept DeltaNet output comes with a (tokens, heads, 64) block
from .placement import segment_checkpoints

GiB = 2**30
LOSS_KINDS = ("fused", "plain")
LOSS_KERNELS = ("auto", "liger", "ours")  # --loss_kernel: whose fused linear cross-entropy (levers/loss.py)
ATTN_RECOMPUTE = ("auto", "always", "never")  # --attn_recompute and --linear_recompute
AUTO_ON_OFF = ("auto", "on", "off")  # --tiled_mlp, --lean_norm, --fused_kernels
TILE_ABOVE_BYTES = 2 * GiB  # --tiled_mlp auto tiles when one seq x intermediate tensor of a layer would exceed this
KEEP_DEVICE_FRACTION = 0.15  # --attn_recompute auto keeps the outputs while they take under this much of the device
KEEP_HOST_FRACTION = 0.5  # ... or, offloaded with the checkpoints, under this much of the host (all local ranks)
# ... or while the planner's estimate of the whole run with them stays under this much of the device (and of the host,
# where the offload puts them): where little else is on the GPU (LoRA's frozen bf16 base, small models) the outputs
# can take more than KEEP_DEVICE_FRACTION and still leave a fifth of the device for what the estimate misses
KEEP_PLAN_FRACTION = 0.8
# --tiled_mlp auto leaves the MLP whole, though over TILE_ABOVE_BYTES, while the planner's estimate of the whole run
# untiled stays under this much of the device. Higher than KEEP_PLAN_FRACTION: what untiling adds is one layer's
# working set, the part of the estimate counted op by op (within 3.4% on the H200, docs/memory.md), and the kept
# outputs are judged first, so the two together are held to this share
UNTILE_PLAN_FRACTION = 0.85
# --keep_projections auto keeps projections only for at least this share of the step by the time model: smaller
# gains are within what it misses between two lever sets (its one measured gain, 2.4%, it predicted to 0.01 s)
KEEP_PROJECTIONS_MIN_GAIN = 0.01
# Only for the families whose memory estimate is measured (their record's `estimate_measured`: on the H200 within 6%,
# docs/memory.md; op by op on the CPU, tests/unit/test_plan.py) do these rules spend memory on the estimate's word
# (Gemma 3's peaks were 15-27% over it before our fused kernels ran its norms and MLP; within 5% since)


@dataclass(frozen=True)
class LeverRequest:
    """The lever flags as typed (see train/config/train_config.py for their help)."""

    loss: str = "fused"
    gradient_checkpointing: bool = True
    attn_recompute: str = "auto"
    offload_activations: bool = False
    linear_recompute: str = "auto"
    tiled_mlp: str = "auto"
    lean_norm: str = "auto"
    fused_kernels: str = "auto"
    share_master_weights: bool = True
    loss_kernel: str = "auto"
    checkpoint_layers: str = "all"  # all, auto, or a number of layers
    gpu_checkpoints: str = "auto"  # with the offload: auto, all, or how many checkpoints stay on the GPU
    checkpoint_every: str = "auto"  # auto, or K: only every K-th layer holds a checkpoint (levers/placement.py)
    keep_projections: str = "auto"  # auto, all, or how many checkpointed layers keep their projections' outputs
    adapter_dropout: float = 0.0  # --lora_dropout under --use_peft: random masks a recompute must repeat

    @classmethod
    def from_config(cls, levers, adapter_dropout: float = 0.0) -> "LeverRequest":
        """The request of the run's levers group (train/config/train_config.py LeverConfig)
        and its adapters' dropout."""
        lean = {"true": "on", "false": "off", True: "on", False: "off"}.get(levers.lean_norm, levers.lean_norm)
        return cls(levers.loss, levers.gradient_checkpointing, levers.attn_recompute, levers.offload_activations,
                   levers.linear_recompute, levers.tiled_mlp, lean, levers.fused_kernels, levers.share_master_weights,
                   levers.loss_kernel, levers.checkpoint_layers, str(levers.gpu_checkpoints),
                   str(levers.checkpoint_every), str(levers.keep_projections), adapter_dropout)


@dataclass(frozen=True)
class DeviceInfo:
    """What the policy needs to know about where the run goes."""

    type: str  # "cuda" or "cpu"
    memory_bytes: int  # of one device (on the CPU: the host's)
    host_memory_bytes: int  # of one host
    local_ranks: int = 1  # ranks sharing that host memory
    triton: bool = True  # Triton importable (our fused kernels)
    liger: bool = True  # liger-kernel installed (a dependency on Linux; imported only where its loss runs)

    @classmethod
    def of(cls, device: torch.device, local_ranks: int) -> "DeviceInfo":
        from .fused_kernels import triton_importable
        from .loss import liger_installed

        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else host
        return cls(device.type, memory, host, local_ranks, triton_importable(), liger_installed())

    @classmethod
    def gpu(cls, memory_gib: float, host_gib: float, local_ranks: int) -> "DeviceInfo":
        """A planned GPU machine (tools/plan.py), with the package's dependencies installed."""
        return cls("cuda", int(memory_gib * GiB), int(host_gib * GiB), local_ranks, True, True)


@dataclass(frozen=True)
class Levers:
    """Every lever, resolved: what the trainer installs and what the planner counts."""

    loss: str = "fused"  # fused chunked loss, or the plain one
    loss_kernel: str = "ours"  # the fused loss's kernel: ours (levers/loss.py) or Liger-Kernel's
    checkpointing: bool = True  # every decoder layer checkpointed
    keep_attention: bool = True  # checkpointed layers keep the attention kernel's outputs (--attn_recompute never)
    # checkpointed Gated DeltaNet layers keep the gated delta rule's outputs where FLA runs it (--linear_recompute
    # never); None: the model has no such layers
    keep_linear: Optional[bool] = None
    offload_activations: bool = False  # checkpoints (and kept outputs) in pinned host memory
    tiled_mlp: bool = False  # the MLP over sequence tiles
    lean_norm: bool = True  # RMSNorms save their input in the model dtype, not an fp32 copy
    fused_kernels: bool = False  # our Triton norms, rotary and SwiGLU
    share_master: bool = True  # same-dtype master weights are the model's partition (ZeRO-3)
    bf16_states: bool = False  # bf16 master weights and optimizer states (the DeepSpeed config's choice)
    offload_optimizer: bool = False  # optimizer states in host memory (the DeepSpeed config's choice)
    gqa_native: bool = True  # k and v reach the kernel with their own head count (fp32 on CUDA copies them out)
    # with checkpointing: how many decoder layers, the first ones, are checkpointed (the others keep their
    # activations); None: all of them
    checkpoint_layers: Optional[int] = None
    # with the offload: how many checkpointed layers, the last ones, keep what they save on the GPU (the others' goes
    # to the host); and with any checkpointing, every how many layers one holds its input (levers/placement.py)
    gpu_checkpoints: int = 0
    checkpoint_every: int = 1
    # how many checkpointed layers, the first ones, keep their projections' outputs (levers/projections.py)
    keep_projections: int = 0
    why: dict = field(default_factory=dict, compare=False)  # lever -> the reason of an `auto` decision

    def flags(self, ds_config: Optional[str] = None) -> str:
        """The command-line flags that ask for exactly these levers."""
        flags = [f"--attn_recompute {'never' if self.keep_attention else 'always'}"]
        if self.keep_linear is not None:
            flags.append(f"--linear_recompute {'never' if self.keep_linear else 'always'}")
        if self.loss == "fused" and self.loss_kernel == "ours":
            flags.append("--loss_kernel ours")
        if not self.checkpointing or self.checkpoint_layers is not None:
            flags.append(f"--checkpoint_layers {self.checkpoint_layers if self.checkpointing else 0}")
        if self.offload_activations:  # both given as numbers: under auto they depend on the machine's memory
            flags.append(f"--offload_activations --gpu_checkpoints {self.gpu_checkpoints} --checkpoint_every "
                         f"{self.checkpoint_every}")
        elif self.checkpointing and self.checkpoint_every > 1:
            flags.append(f"--checkpoint_every {self.checkpoint_every}")
        if self.checkpointing:  # given as a number: under auto it depends on the machine's memory
            flags.append(f"--keep_projections {self.keep_projections}")
        flags.append(f"--tiled_mlp {'on' if self.tiled_mlp else 'off'}")
        if not self.fused_kernels:
            flags.append("--fused_kernels off")
        if ds_config:
            flags.append(f"--ds_config {ds_config}")
        elif self.offload_optimizer:
            flags.append("--ds_config ds_configs/zero3_offload.json")
        elif self.bf16_states:
            flags.append("--ds_config ds_configs/zero3_bf16_states.json")
        return " ".join(flags)

    def checkpointed(self, layers: int) -> int:
        """How many of the model's `layers` are checkpointed (the first ones)."""
        if not self.checkpointing:
            return 0
        return layers if self.checkpoint_layers is None else self.checkpoint_layers

    def keeps_outputs(self, span) -> bool:
        """Whether a checkpointed layer of this span (model/geometry.py) keeps its mixer kernel's outputs for the
        backward (`--attn_recompute never` for attention, `--linear_recompute never` for linear attention)."""
        return self.keep_attention if span.attention else self.keep_linear

    def off(self, lever: str, reason: str) -> "Levers":
        """The same levers with one turned off, and why."""
        return dataclasses.replace(self, **{lever: False}, why={**self.why, lever: reason})


def kept_output_bytes(g: dict, shape, tokens: int, act_bytes: int) -> int:
    """What keeping the mixer outputs of one layer (its `shape`, model/geometry.py) costs per rank (`--attn_recompute
    never`): an attention layer's output and its fp32 log-sum-exp; a Gated DeltaNet layer's output, its decay's
    cumulative sum (fp32) and FLA's A block (sp/gated_delta_op.py: kept where FLA runs the rule)."""
    if shape.span.attention:
        return tokens * (shape.attn_width * act_bytes + shape.heads * 4)
    d = g["linear_attn"]
    return tokens * (d["value_width"] * act_bytes + d["value_heads"] * (FLA_CHUNK * act_bytes + 4))


def projection_features(g: dict, shape) -> list[tuple[int, int]]:
    """(in, out) features of the projections one layer keeps under `--keep_projections` (levers/projections.py):
    its token mixer's input projections, all from the hidden state (geometry's `input_projection_width`)."""
    return [(g["hidden"], shape.input_projection_width)] if shape.input_projection_width else []


def projection_bytes(g: dict, shape, tokens: int, act_bytes: int) -> int:
    """What one layer's kept projection outputs cost per rank: their widths x tokens x the activation's bytes."""
    return tokens * act_bytes * sum(out for _, out in projection_features(g, shape))


def kept_outputs_bytes(g: dict, tokens: int, act_bytes: int, attention: bool = True) -> int:
    """What keeping the mixers' outputs costs per rank, every attention layer (or, `attention=False`, every Gated
    DeltaNet layer): kept_output_bytes."""
    return sum(kept_output_bytes(g, shape, tokens, act_bytes) for shape in g["layer_shapes"]
               if shape.span.attention == attention)


def checkpoint_bytes(g: dict, tokens: int, act_bytes: int) -> int:
    """The checkpointed layer inputs of one rank."""
    return g["layers"] * tokens * g["hidden"] * act_bytes


def _kept_within_rules(kept: int, what: str, g: dict, tokens: int, act_bytes: int, device: DeviceInfo,
                       offload: bool) -> tuple[bool, str]:
    """`auto`'s first rules for kept outputs of `kept` bytes per rank: with the offload they go to the host with the
    checkpoints, from every local rank, and must stay under KEEP_HOST_FRACTION of it; else under
    KEEP_DEVICE_FRACTION of the device."""
    if offload:
        total = (kept + checkpoint_bytes(g, tokens, act_bytes)) * device.local_ranks
        limit = KEEP_HOST_FRACTION * device.host_memory_bytes
        return total < limit, f"auto: {what} and checkpoints {total / GiB:.1f} GiB on the host, " \
                              f"{'under' if total < limit else 'over'} {limit / GiB:.1f} GiB"
    limit = KEEP_DEVICE_FRACTION * device.memory_bytes
    return kept < limit, f"auto: {what} {kept / GiB:.1f} GiB, {'under' if kept < limit else 'over'} " \
                         f"{limit / GiB:.1f} GiB of the device"


def _keep_attention(request: LeverRequest, g: dict, tokens: int, act_bytes: int, device: DeviceInfo,
                    offload: bool) -> tuple[bool, str]:
    if request.attn_recompute != "auto":
        return request.attn_recompute == "never", ""
    if device.type != "cuda":
        return False, "auto: recompute on the CPU"
    return _kept_within_rules(kept_outputs_bytes(g, tokens, act_bytes), "kept outputs", g, tokens, act_bytes, device,
                              offload)


def _keep_linear(request: LeverRequest, g: dict, tokens: int, act_bytes: int, device: DeviceInfo, offload: bool,
                 keep_attention: bool) -> tuple[Optional[bool], str]:
    """`--linear_recompute`: whether the Gated DeltaNet layers keep the gated delta rule's outputs (None for a model
    without them). auto: on the GPU, by the kept attention's rules with the attention's kept outputs counted beside
    them; the planner's estimate may keep them where that is short (_keep_linear_where_the_plan_fits). The torch rule
    (the CPU's) is a chain of small ops that the checkpoint does not keep: only FLA's op is kept."""
    if not g.get("linear_attn"):
        return None, ""
    if request.linear_recompute != "auto":
        return request.linear_recompute == "never", ""
    if device.type != "cuda":
        return False, "auto: recompute on the CPU (the torch rule is not kept)"
    kept = kept_outputs_bytes(g, tokens, act_bytes, attention=False)
    beside = kept_outputs_bytes(g, tokens, act_bytes) if keep_attention else 0
    return _kept_within_rules(kept + beside, "the gated delta rule's and the attention's kept outputs", g, tokens,
                              act_bytes, device, offload)


def _tiled_mlp(mode: str, g: dict, tokens: int, act_bytes: int, dropout: float = 0.0) -> tuple[bool, str]:
    if dropout and mode != "off":
        # DeepSpeed's TiledMLP recomputes each tile in the backward without the forward's random state (checkpointing
        # restores it): the adapters' dropout would draw other masks there, and the gradients would be wrong
        if mode == "on":
            raise ConfigError("--tiled_mlp on recomputes the MLP in the backward with other dropout masks than the "
                              "forward's: use --lora_dropout 0 or --tiled_mlp off")
        return False, "auto: off, --lora_dropout draws masks its recompute would not repeat"
    if mode != "auto":
        return mode == "on", ""
    one = tokens * g["inter"] * act_bytes
    return one > TILE_ABOVE_BYTES, f"auto: one seq x intermediate tensor is {one / GiB:.2f} GiB " \
                                   f"({'over' if one > TILE_ABOVE_BYTES else 'not over'} 2 GiB)"


def _loss_kernel(request: LeverRequest, device: DeviceInfo) -> tuple[str, str]:
    """Whose fused linear cross-entropy runs, and why (under auto). Whether Liger's kernel imports and agrees
    with ours on this device is checked when the loss head is installed (model/surgery.py)."""
    if request.loss != "fused":
        if request.loss_kernel == "liger":
            raise ConfigError("--loss_kernel liger needs --loss fused (the plain loss has no kernel to choose)")
        return "ours", ""
    if request.loss_kernel == "ours":
        return "ours", ""
    if request.loss_kernel == "liger":
        if not device.liger:
            raise ConfigError("--loss_kernel liger: liger-kernel is not installed (pip install liger-kernel); use "
                              "--loss_kernel auto or ours")
        return "liger", ""
    if device.type != "cuda":
        return "ours", "auto: ours (Liger-Kernel's runs on CUDA)"
    if not device.liger:
        return "ours", "auto: ours (liger-kernel is not installed)"
    return "liger", "auto: Liger-Kernel's on CUDA"


def _kept_if(lever: Optional[bool], condition: bool) -> Optional[bool]:
    """An optional keep lever (None: the model has no such layers) switched off where `condition` fails."""
    return None if lever is None else lever and condition


def with_checkpoint_layers(levers: Levers, n: int, layers: int) -> Levers:
    """The same levers with the first `n` of `layers` decoder layers checkpointed (0: none, so nothing is kept
    of the mixers either)."""
    return dataclasses.replace(levers, checkpointing=n > 0, keep_attention=levers.keep_attention and n > 0,
                               keep_linear=_kept_if(levers.keep_linear, n > 0),
                               keep_projections=min(levers.keep_projections, n),
                               checkpoint_layers=None if n >= layers else n)


def _checkpoint_layers(levers: Levers, request: LeverRequest, layers: int, device: DeviceInfo,
                       fits: Optional[Callable[[Levers], bool]]) -> Levers:
    """`--checkpoint_layers`: a number, all, or auto: the fewest checkpointed layers with which `fits` (the planner's
    memory estimate on this device: levers/memory.py) says the run fits. Fewer checkpointed layers is always faster
    (each one saves a recompute), so the fewest that fit is also the fastest."""
    mode = request.checkpoint_layers
    if not levers.checkpointing or mode == "all":
        return levers
    if mode != "auto":
        n = int(mode)
        if n > layers:
            raise ConfigError(f"--checkpoint_layers {n}: the model has {layers} layers; give 0 to {layers}, all or "
                              f"auto")
        return with_checkpoint_layers(levers, n, layers)
    if device.type != "cuda" or fits is None:
        return dataclasses.replace(levers, why={**levers.why, "checkpoint_layers": "auto: every layer (no GPU "
                                                                                    "memory to spend)"})
    for n in range(layers + 1):  # memory falls as n grows: the first that fits is the fastest that fits
        candidate = with_checkpoint_layers(levers, n, layers)
        if fits(candidate):
            return dataclasses.replace(candidate, why={**levers.why, "checkpoint_layers":
                                                       f"auto: {n} of {layers} layers, the fewest that fit"})
    return dataclasses.replace(levers, why={**levers.why, "checkpoint_layers":
                                            "auto: every layer (the plan does not fit even so)"})


def _keep_projections(levers: Levers, value: str, layers: int) -> Levers:
    """`--keep_projections` as a number or all: how many checkpointed layers (the first ones) keep their projections'
    outputs (levers/projections.py), at most the checkpointed ones. auto is judged last
    (_keep_projections_where_faster): here it keeps none."""
    if value == "auto":
        return levers
    if value != "all" and not (str(value).isdigit() and int(value) <= layers):
        raise ConfigError(f"--keep_projections takes auto, all or a number from 0 to {layers} (the model's layers), "
                          f"got {value!r}")
    n = layers if value == "all" else int(value)
    return dataclasses.replace(levers, keep_projections=min(n, levers.checkpointed(layers)))


def _keep_projections_where_faster(levers: Levers, request: LeverRequest, g: dict, device: DeviceInfo,
                                   fits: Optional[Callable[..., bool]],
                                   seconds: Optional[Callable[[Levers], float]]) -> Levers:
    """`--keep_projections auto` on the GPU: of none and the first 1/4, 1/2, 3/4 or all of the checkpointed layers,
    the count the time model (`seconds`: levers/time_model.py) finds fastest, among those with which the planner's
    estimate of the whole run stays under KEEP_PLAN_FRACTION of the device and of the host (with the offload the
    kept outputs go to the host: a fast host side copy, hidden behind the layer's forward while it is shorter). Judged
    after every other lever, on what they leave: per byte the projections save the least (a matmul's forward
    against an attention kernel's or a layer's whole recompute). Kept only for a gain of KEEP_PROJECTIONS_MIN_GAIN
    or more: below it the time model's error is larger than the gain, and the bytes are not free."""
    if request.keep_projections != "auto" or not levers.checkpointing:
        return levers
    n = levers.checkpointed(g["layers"])
    widths = any(shape.input_projection_width for shape in g["layer_shapes"][:n])
    reason = ("the CPU" if device.type != "cuda" else "no input projections to keep" if not widths
              else "no memory estimate measured for this family" if fits is None
              else "no step time to compare by" if seconds is None else "")
    if reason:
        return dataclasses.replace(levers, why={**levers.why, "keep_projections": f"auto: none ({reason})"})
    counts = sorted({max(1, round(n * q)) for q in (0.25, 0.5, 0.75, 1.0)})
    fitting = [candidate for candidate in (dataclasses.replace(levers, keep_projections=k) for k in counts)
               if fits(candidate, KEEP_PLAN_FRACTION, host_share=KEEP_PLAN_FRACTION)]
    base = seconds(levers)
    timed = [(seconds(candidate), candidate) for candidate in fitting]
    best_s, best = min(timed, key=lambda pair: pair[0], default=(base, levers))  # ties: the fewer layers
    gain = max(0.0, 1 - best_s / base)
    if not fitting:  # the bytes only grow with the count: the fewest did not fit
        best, verdict = levers, (f"none: with {counts[0]} layers' the whole plan is over {KEEP_PLAN_FRACTION:.0%} of "
                                 f"the device or the host")
    elif gain < KEEP_PROJECTIONS_MIN_GAIN:
        best, verdict = levers, (f"none: the fastest that fits saves {100 * gain:.2f}% by the time model, under "
                                 f"{100 * KEEP_PROJECTIONS_MIN_GAIN:.0f}%")
    else:
        verdict = (f"{best.keep_projections} of {n} checkpointed layers: {base - best_s:.2f} s ({100 * gain:.1f}%) "
                   f"faster by the time model, under {KEEP_PLAN_FRACTION:.0%} of the device and host")
    return dataclasses.replace(best, why={**levers.why, "keep_projections": f"auto: {verdict}"})


def resolve_levers(request: LeverRequest, g: dict, tokens: int, act_bytes: int, device: DeviceInfo,
                   ds_choices: Optional[dict] = None, fits: Optional[Callable[..., bool]] = None,
                   seconds: Optional[Callable[[Levers], float]] = None) -> Levers:
    """The levers of a run: `g` is the model geometry (model/geometry.py), `tokens` what one rank holds of a
    micro-batch (micro x seq_len / sp), `act_bytes` the activation dtype's size, `ds_choices` what the DeepSpeed
    config fixes (tools/plan.py: ds_config_choices), `fits(levers, share=0.95)` whether given levers fit the
    device within that share of its memory (the planner's estimate, levers/memory.py: fits_on; with `host=False`
    the GPU alone), for `--checkpoint_layers auto`, `--gpu_checkpoints auto` and `--checkpoint_every auto`, and for
    `--attn_recompute auto`, `--tiled_mlp auto` and `--keep_projections auto` in the families whose memory estimate is
    measured, and `seconds(levers)` the time model's step (levers/time_model.py: seconds_on) for `--keep_projections
    auto` (without it that keeps none). Where checkpoints go is judged last: the levers that save time (fewer
    checkpointed layers, kept outputs, a whole MLP) take the GPU's memory first, the checkpoints kept on the GPU what
    is left (they save host memory and copies, hidden behind compute anyway)."""
    ds_choices = ds_choices or {}
    why = {}
    offload = request.offload_activations and device.type == "cuda"
    if request.offload_activations and not offload:
        why["offload_activations"] = "needs CUDA: the host is where activations live already"
    keep, why["keep_attention"] = _keep_attention(request, g, tokens, act_bytes, device, offload)
    keep_linear, why["keep_linear"] = _keep_linear(request, g, tokens, act_bytes, device, offload,
                                                   keep and request.gradient_checkpointing)
    tiled, why["tiled_mlp"] = _tiled_mlp(request.tiled_mlp, g, tokens, act_bytes, request.adapter_dropout)
    fused = request.fused_kernels == "on" or (request.fused_kernels == "auto" and device.type == "cuda"
                                              and device.triton)
    if request.fused_kernels == "auto":
        why["fused_kernels"] = "auto: on for CUDA with Triton" if fused else "auto: off (CUDA with Triton only)"
    loss_kernel, why["loss_kernel"] = _loss_kernel(request, device)
    levers = Levers(loss=request.loss, loss_kernel=loss_kernel, checkpointing=request.gradient_checkpointing,
                    keep_attention=keep and request.gradient_checkpointing, offload_activations=offload,
                    keep_linear=_kept_if(keep_linear, request.gradient_checkpointing),
                    tiled_mlp=tiled, lean_norm=request.lean_norm != "off", fused_kernels=fused,
                    share_master=request.share_master_weights, bf16_states=ds_choices.get("bf16_states", False),
                    offload_optimizer=ds_choices.get("offload_optimizer", False),
                    gqa_native=not (act_bytes == 4 and device.type == "cuda"),
                    why={k: v for k, v in why.items() if v})
    # asked for by number: counted before the MLP, the layer search and the kept outputs spend the memory left
    levers = _keep_projections(levers, request.keep_projections, g["layers"])
    levers = _placed_as_asked(levers, request, g["layers"])
    family = record_of(g.get("model_type"))
    room = fits if family is not None and family.estimate_measured else None
    if request.checkpoint_layers == "auto":  # judged before the layer search spends what is left
        levers = _untile_where_the_plan_fits(levers, request, device, room)
    levers = _checkpoint_layers(levers, request, g["layers"], device, fits)
    levers = _keep_attention_where_the_plan_fits(levers, request, device, room)
    if request.checkpoint_layers != "auto":  # after the kept outputs, which save more where both do not fit
        levers = _untile_where_the_plan_fits(levers, request, device, room)
    levers = _keep_linear_where_the_plan_fits(levers, request, device, room)
    levers = _keep_projections_where_faster(levers, request, g, device, room, seconds)  # the least saved per byte
    return segment_checkpoints(levers, request.checkpoint_every, request.gpu_checkpoints, g["layers"],
                               device.type == "cuda", fits)


def _placed_as_asked(levers: Levers, request: LeverRequest, layers: int) -> Levers:
    """The levers with the checkpoints placed as `--gpu_checkpoints` and `--checkpoint_every` ask where they give
    numbers, so that the rules after it judge (and time) the run as it will be placed: kept outputs of layers whose
    checkpoints stay on the GPU take the GPU's memory, not the host's. Under auto the rules judge every checkpoint on
    the host, one per layer, and segment_checkpoints places them last, on what the rules leave."""
    every = "1" if request.checkpoint_every == "auto" else request.checkpoint_every
    on_gpu = "0" if request.gpu_checkpoints == "auto" else request.gpu_checkpoints
    return segment_checkpoints(levers, every, on_gpu, layers, cuda=False, fits=None)


def _keep_attention_where_the_plan_fits(levers: Levers, request: LeverRequest, device: DeviceInfo,
                                        fits: Optional[Callable[..., bool]]) -> Levers:
    """`--attn_recompute auto` on the GPU also keeps the outputs when the planner's estimate of the whole run with
    them is under KEEP_PLAN_FRACTION of the device and of the host, though they take more than KEEP_DEVICE_FRACTION
    of the device (Qwen3-8B LoRA at 131k: 36.6 GiB kept, 105 GiB planned of 140) or, with the offload, more than
    KEEP_HOST_FRACTION of the host beside the checkpoints (OLMo-3-7B at 131k: 64 GiB, 68.5 GiB planned of 125; its
    full-attention layers' recompute is a sixth of the step). Judged on the layers the run checkpoints (a number of
    them leaves the others' whole activations beside the kept outputs). With `--checkpoint_layers auto` the search
    for the fewest checkpointed layers spends that memory instead, as it always has."""
    if (levers.keep_attention or not levers.checkpointing or request.attn_recompute != "auto" or fits is None
            or device.type != "cuda" or request.checkpoint_layers == "auto"):
        return levers
    return _if_the_plan_fits(levers, "keep_attention", True, KEEP_PLAN_FRACTION, fits, "with them", "kept",
                             host_share=KEEP_PLAN_FRACTION)


def _keep_linear_where_the_plan_fits(levers: Levers, request: LeverRequest, device: DeviceInfo,
                                     fits: Optional[Callable[..., bool]]) -> Levers:
    """`--linear_recompute auto` on the GPU also keeps the gated delta rule's outputs when the planner's estimate of
    the whole run with them stays under KEEP_PLAN_FRACTION of the device and of the host (with the offload they go to
    the host: Qwen3.5-9B at 131k, 36 GiB beside 40 GiB of checkpoints and kept attention, 80 GiB planned of 125).
    Judged last: per byte it saves the least time of the levers (a DeltaNet recurrence's forward, about a quarter of
    its forward and backward)."""
    if (levers.keep_linear is not False or not levers.checkpointing or request.linear_recompute != "auto"
            or fits is None or device.type != "cuda"):
        return levers
    return _if_the_plan_fits(levers, "keep_linear", True, KEEP_PLAN_FRACTION, fits, "with them", "kept",
                             host_share=KEEP_PLAN_FRACTION)


def _untile_where_the_plan_fits(levers: Levers, request: LeverRequest, device: DeviceInfo,
                                fits: Optional[Callable[..., bool]]) -> Levers:
    """`--tiled_mlp auto` on the GPU leaves the MLP whole, though its tensors are over TILE_ABOVE_BYTES, when the
    planner's estimate of the whole run without the tiles is under UNTILE_PLAN_FRACTION of the device. Each tile is
    recomputed in the backward: under checkpointing that is a third forward of the MLP, worth its memory only where
    the memory is short (Qwen3-8B LoRA at 131k on one H200: 3.0 s of a 43.3 s step for 11 GiB of 140)."""
    if not levers.tiled_mlp or request.tiled_mlp != "auto" or fits is None or device.type != "cuda":
        return levers
    return _if_the_plan_fits(levers, "tiled_mlp", False, UNTILE_PLAN_FRACTION, fits, "untiled", "whole")


def _if_the_plan_fits(levers: Levers, lever: str, value: bool, fraction: float, fits: Callable[..., bool],
                      plan: str, verdict: str, host_share: float = 1.0) -> Levers:
    """The levers with `lever` set to `value` if the planner's estimate of the whole run so is under `fraction` of
    the device (and `host_share` of the host), else as they were; the reason says which."""
    changed = dataclasses.replace(levers, **{lever: value})
    under = fits(changed, fraction, host_share=host_share)
    where = "the device" + (" and the host" if host_share < 1 else "")
    why = {**levers.why, lever: levers.why[lever] + (
        f"; the whole plan {plan} is {'under' if under else 'over'} {fraction:.0%} of {where}"
        f"{': ' + verdict if under else ''}")}
    return dataclasses.replace(changed if under else levers, why=why)
