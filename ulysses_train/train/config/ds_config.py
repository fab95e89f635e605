"""One place where the DeepSpeed JSON and the command line are reconciled.

Values that must agree between the two (micro batch, accumulation, train batch = micro x accum x dp, clipping,
lr, precision) are read from both: "auto" or absent in the JSON takes the flag (or its default); a number in the
JSON is used when the flag was not typed; a typed flag that contradicts a number in the JSON is an error naming
both. ZeRO bucket sizes set to "auto" are derived from the hidden size as transformers does. The resolved dict is
the single source of truth from then on: nothing is written twice. The file itself is read and checked by ds_file.py.
"""

from __future__ import annotations

import copy
from typing import Any

from ...errors import ConfigError
from .train_config import TrainConfig

AUTO = "auto"


def _reconcile(ds: dict, key_path: tuple, flag: str, cfg: TrainConfig, explicit: set, default: Any, src: str):
    """Resolves one value shared by the JSON (at key_path) and a flag; writes it into ds and returns it."""
    node = ds
    for k in key_path[:-1]:
        node = node.setdefault(k, {})
    json_value = node.get(key_path[-1], AUTO)
    flag_value = cfg.get(flag)
    if json_value == AUTO:
        value = flag_value if flag_value is not None else default
    elif flag in explicit and flag_value is not None and float(flag_value) != float(json_value):
        raise ConfigError(f"--{flag} {flag_value} contradicts {'.'.join(key_path)} = {json_value} in {src}: "
                          f"set one of them to \"auto\" or make them equal")
    else:
        value = json_value
    node[key_path[-1]] = value
    return value


def _reconcile_betas(params: dict, cfg: TrainConfig, explicit: set, src: str) -> None:
    """optimizer.params.betas: "auto" (or absent) takes (--adam_beta1, --adam_beta2); numbers stand unless a typed
    flag contradicts them."""
    betas = params.get("betas", AUTO)
    flags = (cfg.optim.adam_beta1, cfg.optim.adam_beta2)
    if betas == AUTO:
        params["betas"] = list(flags)
        return
    for i, name in enumerate(("adam_beta1", "adam_beta2")):
        if name in explicit and float(flags[i]) != float(betas[i]):
            raise ConfigError(f"--{name} {flags[i]} contradicts optimizer.params.betas[{i}] = {betas[i]} in {src}: "
                              f"set betas to \"auto\" or make them equal")


def resolve_ds_config(raw: dict, cfg: TrainConfig, explicit: set, dp_size: int, sp_size: int, hidden_size: int,
                      use_bf16: bool, random_init: bool) -> dict:
    ds = copy.deepcopy(raw)
    src = cfg.parallel.ds_config
    # read by DeepSpeedConfig when no mpu is at hand (transformers' zero.Init) to get dp = world / sp
    if ds.get("sequence_parallel_size", sp_size) != sp_size:
        raise ConfigError(f"sequence_parallel_size = {ds['sequence_parallel_size']} in {src} contradicts "
                          f"--sp_size {sp_size}: remove it from the JSON")
    ds["sequence_parallel_size"] = sp_size
    micro = _reconcile(ds, ("train_micro_batch_size_per_gpu",), "micro_batch_size", cfg, explicit, 1, src)
    accum = _reconcile(ds, ("gradient_accumulation_steps",), "grad_accum", cfg, explicit, 1, src)
    _reconcile(ds, ("gradient_clipping",), "max_grad_norm", cfg, explicit, 1.0, src)
    train_batch = micro * accum * dp_size
    if ds.get("train_batch_size", AUTO) not in (AUTO, train_batch):
        raise ConfigError(f"train_batch_size = {ds['train_batch_size']} in {src} is not micro_batch_size {micro} x "
                          f"grad_accum {accum} x data-parallel size {dp_size} = {train_batch}: set it to \"auto\"")
    ds["train_batch_size"] = train_batch
    default_lr = 1e-3 if random_init else 1e-5
    if "optimizer" in ds:
        _reconcile(ds, ("optimizer", "params", "lr"), "lr", cfg, explicit, default_lr, src)
        params = ds["optimizer"].setdefault("params", {})
        if params.get("weight_decay", AUTO) == AUTO:
            params["weight_decay"] = cfg.optim.weight_decay
        _reconcile(ds, ("optimizer", "params", "eps"), "adam_epsilon", cfg, explicit, cfg.optim.adam_epsilon, src)
        _reconcile_betas(params, cfg, explicit, src)
    if ds.get("fp16", {}).get("enabled") in (True, AUTO):
        if ds["fp16"]["enabled"] is True:
            raise ConfigError(f"fp16 is not supported ({src}): use bf16 (--dtype bf16) or fp32")
        ds["fp16"]["enabled"] = False
    bf16 = ds.setdefault("bf16", {})
    if bf16.get("enabled", AUTO) == AUTO:
        bf16["enabled"] = use_bf16
    elif bool(bf16["enabled"]) != use_bf16:
        raise ConfigError(f"bf16.enabled = {bf16['enabled']} in {src} contradicts the training dtype "
                          f"({'bf16' if use_bf16 else 'fp32'}): set it to \"auto\" or change --dtype")
    zero = ds.setdefault("zero_optimization", {})
    derived = {"reduce_bucket_size": hidden_size * hidden_size,
               "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
               "stage3_param_persistence_threshold": 10 * hidden_size}
    for key, value in derived.items():
        if zero.get(key) == AUTO:
            zero[key] = value
    leftovers = [path for path in _auto_paths(ds)]
    if leftovers:
        raise ConfigError(f"{src}: no flag fills {', '.join(leftovers)} = \"auto\": give a value")
    return ds


def _auto_paths(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _auto_paths(v, f"{prefix}{k}.")
    elif node == AUTO:
        yield prefix.rstrip(".")


def resolved_lr(ds: dict, cfg: TrainConfig, random_init: bool) -> float:
    if "optimizer" in ds:
        return float(ds["optimizer"]["params"]["lr"])
    return cfg.optim.lr if cfg.optim.lr is not None else (1e-3 if random_init else 1e-5)


def lever_choices(ds: dict) -> dict:
    """What a DeepSpeed config fixes for the lever policy and the planner: ZeRO stage, bf16 master weights and
    optimizer states, optimizer states in host memory."""
    zero = ds.get("zero_optimization", {})
    bf16 = ds.get("bf16", {})
    offload = (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")
    return {"zero_stage": int(zero.get("stage", 0)), "offload_optimizer": offload,
            "bf16_states": bool(bf16.get("bf16_master_weights_and_grads") and bf16.get("bf16_optimizer_states"))}
