"""Sequence-tiled MLP: the MLP runs over tiles of the sequence, each tile recomputed in the backward, so its
`seq x intermediate` tensors (4 of them in a SwiGLU MLP: 4 x 19 GB at 1M tokens for Qwen3-4B) never exist at full
length. We reuse DeepSpeed's `TiledMLP` autograd function, which also tells ZeRO-3 not to reduce a weight's
gradient until its last tile has added to it."""

from __future__ import annotations

import math
import types

import torch.nn as nn

TILED_MLP_MODES = ("auto", "on", "off")
AUTO_THRESHOLD_BYTES = 2 * 2**30  # tile when one of the four intermediates of a layer would exceed this


def _tiled_forward(tile_tokens: int):
    def forward(self, x):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        # (b, s/sp, h): the tile count depends only on the local length, which is equal on every rank, so ZeRO-3's
        # per-tile parameter gathers stay in step across ranks
        shards = max(1, math.ceil(x.shape[-2] / tile_tokens))
        params = [p for p in self.parameters() if p.requires_grad]
        return TiledMLP.apply(type(self).forward, self, x, shards, params)
    return forward


def should_tile(mode: str, local_tokens: int, intermediate_size: int, bytes_per_value: int) -> bool:
    if mode in ("on", "off"):
        return mode == "on"
    return local_tokens * intermediate_size * bytes_per_value > AUTO_THRESHOLD_BYTES


def enable_tiled_mlp(model: nn.Module, tile_tokens: int) -> int:
    """Patches the forward of every dense decoder MLP (modules named `mlp` with gate/up/down projections);
    returns how many were patched. Sparse MoE blocks are left alone (their experts see a fraction of the tokens)."""
    patched = 0
    for name, module in model.named_modules():
        if name.endswith(".mlp") and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
            module.forward = types.MethodType(_tiled_forward(tile_tokens), module)
            patched += 1
    return patched
