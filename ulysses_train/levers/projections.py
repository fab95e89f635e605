"""Kept input projections (`--keep_projections N`): the first N checkpointed layers keep the outputs of their token
mixer's input projections, so their recompute skips those matmuls.

A checkpointed layer's recompute runs its forward again before its backward: at long context on one GPU the
matmuls are most of that (Qwen3.5-9B at 64k: about 1 s of a 10 s step). A projection's output costs its width x
tokens x 2 bytes, and skipping its matmul saves `in_features` multiply-adds per element kept: every projection from
the hidden state saves the same time per byte (about 6 ms a GB on an H100 at cuBLAS's rate). With the offload the
bytes cross PCIe in the forward, beside the layer's checkpoint, at about 18 ms a GB: a layer can keep what its own
forward hides. The mixer's input projections (attention's q, k, v; a Gated DeltaNet layer's q, k, v, z, b, a; not
where they have biases: mark_projections says why) fit that (Qwen3.5-9B at 64k: 1.6 GB a layer, 29 ms of copies
under a 58 ms forward, by levers/time_model.py); the MLP's gate and up (3.2 GB a layer) do not, nor everything
(5.2 GB: the copies would take twice the forward).

How: a forward hook pair on each such nn.Linear marks the thread as inside a kept projection; the checkpoint's
keeping modes (checkpointing.py) treat a matmul (`aten.mm`, `aten.addmm`) issued there as a kept op, like the
attention kernel: stored in the forward, returned in the recompute instead of run. The forward and the recompute call
the layer's modules in the same order, so the stored outputs come back in order.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

# what nn.Linear issues on the dispatcher: mm (no bias, after flattening the batch dims) or addmm (with a bias)
PROJECTION_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                     "in_proj_qkvz", "in_proj_ba")
_state = threading.local()


def inside_projection() -> bool:
    return getattr(_state, "depth", 0) > 0


def is_kept(func, ops) -> bool:
    """Whether a kept-op mode stores (or returns) this call: an op in `ops`, a matmul only inside a marked
    projection."""
    return func in ops and (func not in PROJECTION_OPS or inside_projection())


def _enter(module, args) -> None:
    _state.depth = getattr(_state, "depth", 0) + 1


def _leave(module, args, output) -> None:
    _state.depth -= 1


def is_projection(name: str) -> bool:
    """Whether the linear layer at `name` (relative to its decoder layer) is a token mixer's input projection."""
    return not name.startswith("mlp.") and name.rsplit(".", 1)[-1] in INPUT_PROJECTIONS


def mark_projections(layer: nn.Module) -> int:
    """Marks the kept projections of one decoder layer (is_projection; PEFT's base layer where LoRA wraps one);
    returns how many."""
    marked = 0
    for name, module in layer.named_modules():
        # not one with a bias: under ZeRO-3 DeepSpeed's linear adds it in place to the matmul's output, which the
        # kept output would then hold, and the recompute add again
        if isinstance(module, nn.Linear) and module.bias is None and is_projection(name.removesuffix(".base_layer")):
            module.register_forward_pre_hook(_enter)
            module.register_forward_hook(_leave, always_call=True)
            marked += 1
    return marked
