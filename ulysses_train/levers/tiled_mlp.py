"""Sequence-tiled MLP: the MLP runs over tiles of the sequence, each tile recomputed in the backward, so its
`seq x intermediate` tensors (4 of them in a SwiGLU MLP: 4 x 19 GB at 1M tokens for Qwen3-4B) never exist at full
length. We reuse DeepSpeed's `TiledMLP` autograd function, which also tells ZeRO-3 not to reduce a weight's
gradient until its last tile has added to it."""

from __future__ import annotations

import math


def tiled_forward(tile_tokens: int):
    """The forward of a dense MLP module over sequence tiles of `tile_tokens` (model/surgery.py installs it)."""
    def forward(self, x):
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        # (b, s/sp, h): the tile count depends only on the local length, which is equal on every rank, so ZeRO-3's
        # per-tile parameter gathers stay in step across ranks
        shards = max(1, math.ceil(x.shape[-2] / tile_tokens))
        params = [p for p in self.parameters() if p.requires_grad]
        return TiledMLP.apply(type(self).forward, self, x, shards, params)
    return forward
