"""Ending a run inside a process that goes on (the Python API): the engine and the process groups released, so that
nothing of the run (its model, optimizer states, gloo worker threads) outlives it.

A gloo group whose Python object outlives `destroy_process_group` keeps its worker threads, and with them the
risk of an abort at interpreter exit (sp/weak_group.py). DeepSpeed keeps references of its own: its group cache
(`deepspeed.utils.groups`), released by its own `deepspeed.comm.destroy_process_group`; and ZeRO-3's
`DeepSpeedZeRoOffload` pushes the model on the module-level `FWD_MODULE_STACK` when it sets up its hooks and never
takes it off, and submodules whose forward runs again inside the backward (checkpointing's recompute) are pushed
without being popped; `engine.destroy()` leaves them all. The model, the engine its hooks point to and every group
its parameters hold would stay for the life of the process. And its `PartitionedParameterCoordinator` caches
`__params_to_release` with `functools.lru_cache` on the method: the class-level cache's keys hold every coordinator,
and through it the parameters. `release_engine` takes the run's modules off that list and clears that cache (a
cache: other engines recompute their entries); if DeepSpeed renames either, it fails loudly rather than leak
quietly.
"""

from __future__ import annotations

import torch.distributed as dist


def release_engine(engine) -> None:
    """engine.destroy() (ZeRO's hooks and buffers), then the model off ZeRO-3's forward-module stack."""
    engine.destroy()
    from deepspeed.runtime.zero import parameter_offload

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if not isinstance(stack, list):
        raise RuntimeError("deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK is gone: the release of ZeRO-3's "
                           "model reference (ulysses_train/train/process/teardown.py) must follow DeepSpeed's change")
    ours = {id(module) for module in engine.module.modules()}
    stack[:] = [module for module in stack if id(module) not in ours]
    _params_to_release_cache().cache_clear()


def _params_to_release_cache():
    """The lru_cache of PartitionedParameterCoordinator.__params_to_release (under DeepSpeed's NVTX wrapper)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    method = vars(PartitionedParameterCoordinator).get("_PartitionedParameterCoordinator__params_to_release")
    found = [method] + [cell.cell_contents for cell in getattr(method, "__closure__", None) or ()]
    caches = [f for f in found if hasattr(f, "cache_clear")]
    if not caches:
        raise RuntimeError("PartitionedParameterCoordinator.__params_to_release is no longer an lru_cache: the "
                           "release of its cache (ulysses_train/train/process/teardown.py) must follow "
                           "DeepSpeed's change")
    return caches[0]


def destroy_process_groups(groups=None) -> None:
    """Through DeepSpeed's comm layer, which also drops DeepSpeed's cached references: every group (the default one
    and all the others) when `groups` is None, else only these (ours, in a process whose default group stays)."""
    import deepspeed.comm as ds_comm

    if not dist.is_initialized():
        return
    if groups is None:
        ds_comm.destroy_process_group()
        return
    for group in groups:
        ds_comm.destroy_process_group(group)
