"""A run's layout, resolved in one place: the SP, ring, Ulysses and DP sizes, the attention kernel and the support
check, from the flags, the model's config and the machine.

The trainer (train/run/trainer.py: run_layout), `--verify` (the trainer's), the planner (`plan` with its own flags
and `plan -- <train flags>`), the preview and eval_positions each call `resolve_layout`: a run the planner plans is
the run the trainer builds, and a run the trainer refuses the planner refuses with the same message. Callers that
hold a TrainConfig take its flags from `TrainConfig.layout_flags()` (train/config/train_config.py); the planner's
own flags and eval_positions build `LayoutFlags` themselves.

The machine is a `Target`: the one this process runs on (the trainer passes its device and capability), or the one
planned (`Target.planned`: CUDA GPUs of an H200's compute capability, the kernels installed), so that the planner
and the preview resolve on a machine without a GPU what the trainer resolves on the GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError
from . import dims, kernels
from .support import LayerMixer, check_support, layer_mixers

H200_CAPABILITY = (9, 0)  # compute capability of an H100/H200: FA4's kernels run from here


def attention_heads(config) -> tuple[int, int]:
    """Query and KV heads for the parallel sizes (sp/dims.py); where layers differ (Gemma 4's global layers), the
    fewest KV heads any attention layer has. The support check then checks every layer's own (sp/support.py)."""
    q = config.num_attention_heads
    kv = [m.kv_heads for m in layer_mixers(config) if m.attention]
    return q, min(kv) if kv else q


def widest_head_dim(config) -> int:
    """The widest attention head of any layer (Gemma 4's global layers: `global_head_dim`, or a per-layer
    `head_dim`), for the kernel choice (sp/kernels.py: resolve_kernel)."""
    per_layer = getattr(config, "per_layer_config", None)
    views = [config] if per_layer is None else [per_layer[i] for i in range(config.num_hidden_layers)]
    return max([getattr(v, "head_dim", None) or config.hidden_size // config.num_attention_heads for v in views]
               + [getattr(config, "global_head_dim", None) or 0])


@dataclass(frozen=True)
class LayoutFlags:
    """The flags a layout is resolved from, as typed (nothing resolved yet)."""

    sp_size: Optional[int] = None
    """--sp_size; None: the ranks of one node (the target's `local_world_size`, divided into the world)."""
    ring_size: Optional[int] = None
    """--ring_size as a number; None: auto, the smallest ring that leaves a Ulysses degree the heads allow."""
    attn_kernel: str = "auto"
    """--attn_kernel: auto, sdpa, flash_attn or flash_attn_4 (sp/kernels.py: resolve_kernel)."""
    dtype: str = "auto"
    """--dtype: auto (bf16 on CUDA, fp32 elsewhere), bf16 or fp32; the kernel choice depends on it."""
    packing: bool = False
    """--packing: several documents a row, each attended (and each recurrence run) on its own."""
    pairs: bool = False
    """Preference pairs (--method other than sft): a pair's two sides are two documents of a row, so the support
    check sees the run as packed whatever --packing says."""
    lengths: dict = field(default_factory=dict)
    """Each sequence length the run cuts into shards, by its flag (seq_len, verify_seq_len): {flag: tokens}."""
    pad_to_sp: bool = False
    """--pad_to_sp: lengths that are not a multiple of the shards are padded instead of refused."""


@dataclass(frozen=True)
class Target:
    """The machine a layout is resolved for."""

    world_size: int
    """Every rank of the job (GPUs, or processes on a CPU)."""
    local_world_size: Optional[int] = None
    """Ranks on one node: the default --sp_size keeps a sequence inside one. Only read when --sp_size is not given
    (the trainer counts them with a collective, so it leaves this None where --sp_size is given)."""
    device_type: str = "cpu"
    """torch's device type: cuda, cpu, ..."""
    capability: tuple[int, int] = (0, 0)
    """CUDA compute capability (major, minor); (0, 0) off CUDA. FA4 runs from 9.0."""
    kernels_installed: bool = False
    """True: the kernels' packages are taken as installed (a planned machine); False: this environment is asked."""

    @classmethod
    def planned(cls, gpus: int, gpus_per_node: int = 8) -> "Target":
        """What the planner plans for: `gpus` CUDA GPUs of an H200's capability, `gpus_per_node` a node, FA4 and
        FA2 installed (what the trainer's `auto` takes there)."""
        return cls(gpus, min(gpus, gpus_per_node), "cuda", H200_CAPABILITY, kernels_installed=True)


@dataclass(frozen=True)
class Layout:
    """How a run lays the model over its ranks, and what the support check saw."""

    world_size: int
    """Every rank of the job; dp_size x sp_size."""
    sp_size: int
    """Ranks that share one sequence (consecutive ranks): ulysses_size x ring_size."""
    ring_size: int
    """Ring attention degree inside an SP group (1: Ulysses alone)."""
    ulysses_size: int
    """Ranks of one Ulysses group, which split the heads: sp_size / ring_size."""
    dp_size: int
    """Data-parallel degree: world_size / sp_size."""
    kernel: str
    """The local attention kernel, resolved: sdpa, flash_attn or flash_attn_4."""
    bf16: bool
    """The run computes in bf16 (--dtype bf16, or auto on CUDA); else fp32."""
    device_type: str
    """The device type the kernel and the support check were resolved for."""
    packing: bool
    """Rows hold several documents as the support check saw it: --packing, or preference pairs (two documents a
    pair)."""
    layers: tuple[LayerMixer, ...]
    """One token mixer per decoder layer, as the support check accepted them (sp/support.py)."""


def resolve_layout(flags: LayoutFlags, config, target: Target) -> Layout:
    """The layout of a run of `config` with `flags` on `target`, or the ConfigError (naming the flag) that the
    trainer stops with: the SP size (the default from the node), the ring (--ring_size auto against the heads), every
    divisibility rule (sp/dims.py: validate), the kernel (sp/kernels.py: resolve_kernel) and the support check
    (sp/support.py: check_support), in that order."""
    sp_size = flags.sp_size
    if sp_size is None:
        if target.local_world_size is None:
            raise ValueError("the default --sp_size needs the target's local_world_size")
        sp_size = math.gcd(target.local_world_size, target.world_size)
    heads = attention_heads(config)  # (query heads, the fewest KV heads of any attention layer)
    ring_size = dims.resolve_ring_size(flags.ring_size or "auto", sp_size, *heads)
    parallel = dims.validate(target.world_size, sp_size, *heads, flags.lengths, flags.pad_to_sp, ring_size)
    bf16 = flags.dtype == "bf16" or (flags.dtype == "auto" and target.device_type == "cuda")
    kernel = kernels.resolve_kernel(flags.attn_kernel, target.device_type, bf16, target.capability,
                                    widest_head_dim(config), target.kernels_installed)
    packing = flags.packing or flags.pairs
    layers = check_support(config, sp_size, ring_size, kernel, target.device_type, packing)
    return Layout(target.world_size, sp_size, ring_size, parallel.ulysses_size, parallel.dp_size, kernel, bf16,
                  target.device_type, packing, tuple(layers))


def layout_or_refusal(flags: LayoutFlags, config, target: Target) -> tuple[Optional[Layout], Optional[str]]:
    """(the layout, None), or (None, the ConfigError's message) where the trainer would refuse these flags: for the
    planner, which tries layouts and reports the ones that run."""
    try:
        return resolve_layout(flags, config, target), None
    except ConfigError as e:
        return None, str(e)
