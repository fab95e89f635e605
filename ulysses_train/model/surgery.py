"""Every change the trainer makes to a transformers model, in one place, each declared: what it replaces, which
modules it expects to patch, and the lever and flag that ask for it.

| patch | replaces | expects |
|---|---|---|
| loss head | the LM head's class (nn.Linear) by `LMHeadWithLoss`: same parameters and tying (a LoRA'd head: the base
  layer's, and the forward of PEFT's layer around it by `lora_head_forward`) | the output embedding |
| checkpointing | `_gradient_checkpointing_func` of every layer transformers checkpoints, by ours, one per layer with
  its place (`--checkpoint_layers N`: the layers after the first N are not checkpointed; `--gpu_checkpoints`: which
  offload; `--checkpoint_every`: its segment) | every decoder layer |
| RMSNorm | the forward of each norm computing Llama's, T5's or the zero-centred RMSNorm, by the lean (or fused) one in
  the same arithmetic | every `*RMSNorm` module |
| gated RMSNorm | the forward of each gated norm computing Llama's norm times silu(gate) (the Gated DeltaNet layers'
  output norm), by the fused kernel | every `*RMSNormGated` module |
| rotary | `apply_rotary_pos_emb` as each attention forward reads it, by the fused kernel | every `*.self_attn` |
| gated MLP | the forward of each MLP computing down(act(gate) * up) with silu or tanh GELU, by the fused product |
  every dense `*.mlp` |
| tiled MLP | the forward of each dense MLP, by DeepSpeed's TiledMLP over sequence tiles | every dense `*.mlp` |
| DeltaNet mixer | the forward of each Gated DeltaNet mixer, by ours (sp/deltanet.py): the rule's kernel of
  --linear_kernel, the head all-to-all under SP, restarts at packed documents | every `linear_attention` layer's mixer |

What a module computes decides whether it is patched (model/matching.py), not how its code is spelt. A lever the
policy turned on that patches no module is an error naming its flag when the flag asked for it, and under `auto`
turns the lever off (so the levers the planner and the log report are the ones that run), with the reason. The
class swaps go through subclasses made once per original class; the rotary patch gives the attention class a copy
of its forward bound to module globals that name our function, so nothing global changes while a model runs.
`tests/unit/test_surgery.py` pins how many modules each patch takes in every supported family on the installed
transformers, so a release that moves one of them fails there.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..errors import ConfigError
from ..levers.checkpointing import make_checkpoint_fn
from ..levers.fused_kernels import (
    GatedMulFunction,
    RotaryFunction,
    fused_norm_forward,
    gated_rms_norm,
    kernels_run_on,
    rotary_fits,
    triton_importable,
)
from ..levers.lean_norm import lean_forward, norm_epsilon
from ..levers.loss import LMHeadWithLoss, backbone, liger_check, lora_head_forward
from ..levers.offload import HostOffload
from ..levers.placement import layer_places
from ..levers.policy import LeverRequest, Levers
from ..levers.projections import mark_projections
from ..levers.segments import SegmentChain
from ..levers.tiled_mlp import tiled_forward
from ..sp.all_to_all import group_size
from ..sp.deltanet import is_deltanet
from ..sp.deltanet import layout_of as deltanet_layout
from ..sp.deltanet import sp_forward as deltanet_forward
from ..sp.linear_kernel import LinearKernel, choose_linear_kernel
from .matching import (
    computes_gated_norm,
    computes_llama_rotary,
    gated_mlp_activation,
    rebind_global,
    rms_norm_rule,
    rotary_keeps_input_dtype,
    uses_global,
)

_SUBCLASSES: dict[tuple, type] = {}  # (original class, what replaces) -> the subclass swapped in


def _swap_class(module: nn.Module, tag: str, attrs: dict) -> None:
    key = (type(module), tag)
    if key not in _SUBCLASSES:  # in the original's module, where transformers and tools look a class up
        _SUBCLASSES[key] = type(f"{tag}{type(module).__name__}", (type(module),),
                                {"__module__": type(module).__module__, **attrs})
    module.__class__ = _SUBCLASSES[key]


def _dense_mlps(model: nn.Module) -> list[nn.Module]:
    """Decoder MLPs with gate, up and down projections (sparse MoE blocks have none of their own)."""
    return [m for name, m in model.named_modules()
            if name.endswith(".mlp") and all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj"))]


# ---------------------------------------------------------------- the patches, each usable on its own


def install_loss_head(model: nn.Module, fused: bool = True, chunk_size: int = 4096, kernel: str = "ours"
                      ) -> nn.Module:
    """The LM head returns the SP loss when called with labels (levers/loss.py), logits otherwise; `kernel`: whose
    fused loss ("ours" or "liger"). A head with PEFT's LoRA layer around it (--lora_target_modules lm_head) keeps
    it: the loss runs in the base layer with the adapters' low-rank term, whose B weights ZeRO-3 gathers for the
    base layer's forward (registered as its external parameters, DeepSpeed's way for a weight another module
    uses)."""
    head = model.get_output_embeddings()
    if hasattr(head, "lora_B") and hasattr(head, "base_layer"):  # PEFT's LoRA layer
        lora, head = head, head.get_base_layer()
        _swap_class(lora, "LossHead", {"forward": lora_head_forward})
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter

        for b in lora.lora_B.values():
            register_external_parameter(head, b.weight)
    if not isinstance(head, nn.Linear):
        raise TypeError(f"the model's output embedding is a {type(head).__name__}, not nn.Linear")
    head.__class__ = LMHeadWithLoss
    head.fused, head.chunk_size, head.kernel = fused, chunk_size, kernel if fused else "ours"
    head.softcap = getattr(model.config, "final_logit_softcapping", None) or None  # Gemma 2's, before the loss
    return head


def enable_checkpointing(model: nn.Module, keep_attention: bool, offload: Optional[HostOffload],
                         layers: Optional[int] = None, gpu_checkpoints: int = 0, every: int = 1,
                         keep_linear: bool = False, keep_projections: int = 0) -> int:
    """transformers' gradient checkpointing, with our checkpoint function on every layer that has one, keeping the
    attention kernels' outputs (`keep_attention`) and the gated delta rule's (`keep_linear`), and in the first
    `keep_projections` checkpointed layers their projections' (levers/projections.py); with `layers`
    only the first that many decoder layers are checkpointed and the others keep their activations. With `offload`
    the last `gpu_checkpoints` checkpointed layers keep what they save on the GPU, the others offload it; `every`:
    segments of that many layers share a checkpoint (levers/placement.py says why, and which layers).

    Why the first: in the backward the last layers run first, so the uncheckpointed ones free their activations
    before any recompute begins (the recompute's working set never adds to them), and the activations that would
    live longest (the first layers', from the start of the forward to the end of the backward) are the ones not
    kept. (Megatron's `--recompute-method block` makes the same choice.)"""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers' newer name for the switch
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    from transformers.modeling_layers import GradientCheckpointingLayer

    fn, patched = make_checkpoint_fn(keep_attention, offload, keep_linear=keep_linear), 0
    decoder = _decoder_layers(model)
    n = len(decoder) if layers is None else min(layers, len(decoder))
    levers = Levers(checkpoint_layers=n, offload_activations=offload is not None, gpu_checkpoints=gpu_checkpoints,
                    checkpoint_every=every, keep_projections=keep_projections)
    chain, own = SegmentChain(), {}
    for i, (layer, place) in enumerate(zip(decoder, layer_places(levers, len(decoder)))):
        if place.checkpointed:
            last = i % every == every - 1 or i == n - 1
            projections = place.keeps_projections and mark_projections(layer) > 0
            own[id(layer)] = make_checkpoint_fn(keep_attention, offload if place.on_host else None,
                                                (chain, i % every, last) if every > 1 else None, keep_linear,
                                                projections)
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = own.get(id(module), fn)
            patched += isinstance(module, GradientCheckpointingLayer)  # the layers; the backbone has the flag too
    if layers is not None:
        for layer in _decoder_layers(model)[layers:]:
            layer.gradient_checkpointing = False  # transformers' layer then runs as is, saving what autograd saves
    return patched


def install_lean_norms(model: nn.Module, fused: bool = False) -> int:
    """Every module computing one of transformers' RMSNorm arithmetics (Llama's, T5's, zero-centred: lean_norm.py)
    saves less for its backward, computing the same; fused: one Triton kernel each way."""
    tag, forward = ("Fused", fused_norm_forward) if fused else ("Lean", lean_forward)
    patched = 0
    for module in model.modules():
        rule = None if type(module) in _SUBCLASSES.values() else rms_norm_rule(type(module))
        if rule is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
            continue
        module._norm_rule = rule
        _swap_class(module, tag, {"forward": forward})
        patched += 1
    return patched


def _fused_gated_norm_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return gated_rms_norm(hidden_states, gate, self.weight, norm_epsilon(self))


def install_fused_gated_norms(model: nn.Module) -> int:
    """Every gated norm computing Llama's RMSNorm times silu(gate) (the Gated DeltaNet layers' output norm; model/
    matching.py probes it with the module's own activation) runs as one Triton kernel each way."""
    patched = 0
    for module in model.modules():
        if type(module) in _SUBCLASSES.values() or not isinstance(getattr(module, "weight", None), torch.Tensor):
            continue
        if computes_gated_norm(type(module), getattr(module, "activation", None)):
            _swap_class(module, "Fused", {"forward": _fused_gated_norm_forward})
            patched += 1
    return patched


def _fused_rotary(original: Callable) -> Callable:
    """Our kernel in place of `original`, returning q and k in the dtype `original` would: their own where it casts
    back (OLMo 3: fp32 cos and sin, bf16 q and k), else the promoted one."""
    keeps_dtype = rotary_keeps_input_dtype(original)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not rotary_fits(q, k, cos, sin, unsqueeze_dim):
            return original(q, k, cos, sin, unsqueeze_dim)
        return (RotaryFunction.apply(q, cos, sin, q.dtype if keeps_dtype else None),
                RotaryFunction.apply(k, cos, sin, k.dtype if keeps_dtype else None))
    return apply_rotary_pos_emb


def install_fused_rotary(model: nn.Module) -> int:
    """Every attention module whose forward applies the Llama rotary embedding through its modeling file's
    `apply_rotary_pos_emb` runs our kernel instead."""
    patched = 0
    for name, module in model.named_modules():
        cls = type(module)
        if not name.endswith("self_attn") or cls in _SUBCLASSES.values():
            continue
        if not uses_global(cls.forward, "apply_rotary_pos_emb"):
            continue
        # the function the forward reads: from the globals of the file that defines it (maybe a parent class's)
        original = inspect.unwrap(cls.forward).__globals__.get("apply_rotary_pos_emb")
        if not computes_llama_rotary(original):
            continue
        forward = rebind_global(cls.forward, "apply_rotary_pos_emb", _fused_rotary(original))
        if forward is None:
            continue
        _swap_class(module, "FusedRotary", {"forward": forward})
        patched += 1
    return patched


def _fused_mlp_forward(self, x):
    return self.down_proj(GatedMulFunction.apply(self.gate_proj(x), self.up_proj(x), self._gated_act))


def install_fused_mlp(model: nn.Module) -> int:
    """Every dense MLP computing down(act(gate(x)) * up(x)) with a gated activation the kernel has (SwiGLU's silu,
    Gemma's tanh GELU) runs act(gate) * up as one kernel each way."""
    patched = 0
    for module in _dense_mlps(model):
        act = None if type(module) in _SUBCLASSES.values() else gated_mlp_activation(type(module),
                                                                                     getattr(module, "act_fn", None))
        if act is None:
            continue
        module._gated_act = act
        _swap_class(module, "Fused", {"forward": _fused_mlp_forward})
        patched += 1
    return patched


def install_deltanet_mixers(model: nn.Module, sp_group, kernel: LinearKernel, documents=None) -> int:
    """Every Gated DeltaNet mixer runs our forward (sp/deltanet.py): the rule's kernel of --linear_kernel, the conv
    and the recurrence over the whole sequence for its rank's heads under SP (an SP group of one, or None: no
    all-to-all), and, with `documents` (the Ulysses attention, whose `doc_lengths` it reads: packing), restarting at
    each document. A module lacking what the forward reads is a TypeError naming the transformers version, before
    any step."""
    sp = group_size(sp_group)
    mixers = [m for m in model.modules() if is_deltanet(m) and type(m) not in _SUBCLASSES.values()]
    for module in mixers:
        module._sp_layout = deltanet_layout(module)
        module._sp_group = sp_group if sp > 1 else None
        module._sp_rank = torch.distributed.get_rank(sp_group) if sp > 1 else 0
        module._sp_documents = None if documents is None else weakref.ref(documents)
        module._sp_kernel = kernel
        _swap_class(module, "SequenceParallel", {"forward": deltanet_forward})
    return len(mixers)


def enable_tiled_mlp(model: nn.Module, tile_tokens: int) -> int:
    """Every dense MLP runs over sequence tiles (its class's forward per tile, so it composes with the fused one)."""
    mlps = _dense_mlps(model)
    for module in mlps:
        module.forward = types.MethodType(tiled_forward(tile_tokens), module)
    return len(mlps)


# ---------------------------------------------------------------- declared, counted, reconciled with the policy


@dataclass(frozen=True)
class Patch:
    name: str
    lever: str  # the Levers field that asks for it
    flag: str  # the flag that controls that lever
    expected: Callable[[nn.Module], int]  # how many modules of this model it should patch


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    return list(getattr(backbone(model), "layers", []))


def _count_layers(model: nn.Module) -> int:
    return len(_decoder_layers(model))


PATCHES = {
    "loss head": Patch("loss head", "loss", "--loss", lambda m: 1),
    "checkpointing": Patch("checkpointing", "checkpointing", "--gradient_checkpointing", _count_layers),
    "RMSNorm": Patch("RMSNorm", "lean_norm", "--lean_norm",
                     lambda m: sum(type(x).__name__.endswith("RMSNorm") for x in m.modules())),
    "gated RMSNorm": Patch("gated RMSNorm", "fused_kernels", "--fused_kernels",
                           lambda m: sum(type(x).__name__.endswith("RMSNormGated") for x in m.modules())),
    "rotary": Patch("rotary", "fused_kernels", "--fused_kernels",
                    lambda m: sum(n.endswith("self_attn") for n, _ in m.named_modules())),
    "gated MLP": Patch("gated MLP", "fused_kernels", "--fused_kernels", lambda m: len(_dense_mlps(m))),
    "tiled MLP": Patch("tiled MLP", "tiled_mlp", "--tiled_mlp", lambda m: len(_dense_mlps(m))),
    # not a lever: installed on every model with DeltaNet layers (install_deltanet_mixers), one per
    # `linear_attention` layer
    "DeltaNet mixer": Patch("DeltaNet mixer", "", "--linear_kernel",
                         lambda m: list(getattr(m.config, "layer_types", None) or []).count("linear_attention")),
}


@dataclass
class SurgeryReport:
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)  # patch -> (patched, expected)

    def describe(self) -> str:
        return ", ".join(f"{name} {done}/{want}" for name, (done, want) in self.counts.items())


def apply_sp_patches(model: nn.Module, sp_group, report: SurgeryReport, device: torch.device,
                     linear_kernel: str = "auto", documents=None) -> Optional[LinearKernel]:
    """The patches sequence parallelism and packing need beyond the attention function (today the DeltaNet mixers,
    on every model that has them, with the rule's kernel of `linear_kernel` chosen here; `documents`: the Ulysses
    attention when packing), recorded in `report`; a model whose mixers this transformers no longer lets us patch,
    all of them, stops here. Returns the chosen kernel, or None for a model without DeltaNet layers."""
    expected = PATCHES["DeltaNet mixer"].expected(model)
    if not expected:
        return None
    first = next(m for m in model.modules() if is_deltanet(m))
    kernel = choose_linear_kernel(linear_kernel, device, LinearKernel("torch").rule(first))
    done = install_deltanet_mixers(model, sp_group, kernel, documents)
    if done != expected:
        raise RuntimeError(f"DeltaNet mixer patched {done} of the {expected} `linear_attention` layers' mixers of "
                           f"this {type(model).__name__} (model/surgery.py): the others would run on their own shard")
    report.counts["DeltaNet mixer"] = (done, expected)
    return kernel


def _explicit(request: LeverRequest, lever: str) -> bool:
    """Whether the flag asked for the lever outright (so matching nothing is an error, not a quiet `off`)."""
    mode = {"lean_norm": request.lean_norm, "fused_kernels": request.fused_kernels, "tiled_mlp": request.tiled_mlp}
    return mode.get(lever, "on") == "on"


def check_fused_kernels(levers: Levers, request: LeverRequest, device: torch.device, dtype: torch.dtype) -> Levers:
    from ..levers.fused_check import self_check

    if not triton_importable():
        problem = "Triton is not installed (pip install triton)"
    elif not kernels_run_on(device):
        problem = f"they run on CUDA (or on the CPU under TRITON_INTERPRET=1), not on {device.type}"
    else:
        problem = self_check(device, dtype)
    if problem is None:
        return levers
    if _explicit(request, "fused_kernels"):
        raise ConfigError(f"--fused_kernels on: {problem}; use --fused_kernels auto or off")
    return levers.off("fused_kernels", f"auto: off, {problem}")


def check_liger_loss(levers: Levers, request: LeverRequest, device: torch.device, dtype: torch.dtype) -> Levers:
    """Liger's loss where the policy chose it, if it runs here and agrees with ours; else an error naming
    --loss_kernel when the flag asked for it, and ours, with the reason, under auto."""
    problem = liger_check(device, dtype)
    if problem is None:
        return levers
    if request.loss_kernel == "liger":
        raise ConfigError(f"--loss_kernel liger: {problem}; use --loss_kernel auto or ours")
    return dataclasses.replace(levers, loss_kernel="ours",
                               why={**levers.why, "loss_kernel": f"auto: ours, Liger-Kernel's failed: {problem}"})


def apply_levers(model: nn.Module, levers: Levers, request: LeverRequest, device: torch.device, dtype: torch.dtype,
                 loss_chunk_size: int, mlp_tile_tokens: int, offload: Optional[HostOffload]
                 ) -> tuple[Levers, SurgeryReport]:
    """Installs what `levers` asks for; returns the levers that run (auto ones that matched nothing turned off, with
    why) and how many modules each patch took of those it expected."""
    if levers.fused_kernels:
        levers = check_fused_kernels(levers, request, device, dtype)
    if levers.loss_kernel == "liger":
        levers = check_liger_loss(levers, request, device, dtype)
    steps = [("checkpointing", lambda: enable_checkpointing(model, levers.keep_attention, offload,
                                                             levers.checkpoint_layers, levers.gpu_checkpoints,
                                                             levers.checkpoint_every, levers.keep_linear,
                                                             levers.keep_projections)),
             ("loss head", lambda: int(install_loss_head(model, levers.loss == "fused", loss_chunk_size,
                                                         levers.loss_kernel) is not None)),
             ("RMSNorm", lambda: install_lean_norms(model, fused=levers.fused_kernels)),
             ("gated RMSNorm", lambda: install_fused_gated_norms(model)),
             ("rotary", lambda: install_fused_rotary(model)),
             ("gated MLP", lambda: install_fused_mlp(model)),
             ("tiled MLP", lambda: enable_tiled_mlp(model, mlp_tile_tokens))]
    report, by_lever = SurgeryReport(), {}
    for name, install in steps:
        patch = PATCHES[name]
        wanted = getattr(levers, patch.lever) or (name == "RMSNorm" and levers.fused_kernels)
        if not wanted:
            continue
        report.counts[name] = (install(), patch.expected(model))
        lever = "fused_kernels" if name == "RMSNorm" and levers.fused_kernels else patch.lever
        by_lever.setdefault(lever, []).append(name)
    if request.lean_norm == "on" and report.counts.get("RMSNorm", (1, 1))[0] == 0:  # asked for, whatever fused says
        by_lever["lean_norm"] = ["RMSNorm"]
    for lever, names in by_lever.items():
        if sum(report.counts[n][0] for n in names) > 0:
            continue
        flag = PATCHES[names[-1]].flag
        if _explicit(request, lever):
            raise ConfigError(f"{flag}: no module of this {type(model).__name__} matched ({', '.join(names)}); "
                              f"turn it off with {flag} {'false' if lever == 'checkpointing' else 'off'}")
        levers = levers.off(lever, f"auto: off, no module of {type(model).__name__} computes what it replaces")
    return levers, report

