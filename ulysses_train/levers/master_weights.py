"""One copy of the weights under ZeRO-3 when the optimizer's master weights have the model's dtype.

DeepSpeed's ZeRO-3 keeps the optimizer's "master" partition (`fp32_partitioned_groups_flat`) beside the model's
partition (`fp16_partitioned_groups_flat`). When the two have the same dtype (bf16 states with
`bf16_master_weights_and_grads`, or fp32 training) the master is a copy of identical numbers: DeepSpeed means to
share the buffer then, but its check compares a `torch.device` with a device *string*, which is never equal
(DeepSpeed 0.19.8, `_setup_for_real_optimizer`), so the copy is made anyway. That copy is 2 bytes per parameter in
bf16, the difference between DeepSpeed's 10 bytes per parameter and TRL's 8 (pure bf16 AdamW). What sharing it
saves on a real step is measured in docs/benchmarks.md and counted in docs/memory.md.

`share_master_weights(optimizer)` points each master partition at the model partition's memory after
`deepspeed.initialize`. The optimizer keeps its tensor objects (its parameter groups and states stay keyed by them);
DeepSpeed's copy of the updated master into the model partition after each step becomes a copy onto itself. The
numbers are those of the unshared run, bit for bit: there the copy holds the same values
(tests/distributed/test_checkpoints.py compares losses and final weights of both).
"""

from __future__ import annotations


def share_master_weights(optimizer) -> int:
    """Makes each same-dtype master partition share the model partition's memory; returns the bytes freed (0 when
    there is nothing to share: another ZeRO stage, optimizer or parameter offload, or different dtypes)."""
    masters = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    models = getattr(optimizer, "fp16_partitioned_groups_flat", None)
    if not masters or not models or len(masters) != len(models):
        return 0
    if getattr(optimizer, "offload_optimizer", False) or getattr(optimizer, "offload_param", False):
        return 0  # the master lives on the CPU or NVMe: a different device, nothing to share
    freed = 0
    for master, model in zip(masters, models):
        if model is None or master.data_ptr() == model.data_ptr():
            continue
        if master.dtype != model.dtype or master.device != model.device or master.shape != model.shape:
            continue
        master.data = model.data  # same numbers (the master was made as a copy of the model partition)
        freed += model.numel() * model.element_size()
    return freed
