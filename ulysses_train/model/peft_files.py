"""PEFT's adapter folder from a --use_peft checkpoint: what `PeftModel.from_pretrained(base, folder)` and vLLM's
LoRA loader read (adapter_config.json with the base model's id or path, adapter_model.safetensors).

Every checkpoint of an adapter run holds it at its top (train/checkpoints/checkpoint.py writes it before the manifest),
and `export` writes it on its own (train/checkpoints/export_model.py). Both go through PEFT's own `save_pretrained` on a
PeftModel built on the meta device from the run's config, with the trained values put in, so the file's names and layout
are PEFT's by construction rather than a copy of its conventions. The values are DeepSpeed's fp32 master weights,
consolidated from the ZeRO shards on the CPU (zero_to_fp32, by the caller): the adapters as trained, not rounded
to bf16.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from ..errors import CheckpointError
from .adapters import ADAPTER_CONFIG, ADAPTER_MODULES, peft_name
from .build import without_zero3

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_model(checkpoint: str, config, base: Optional[str], trained: dict, base_name: Optional[str] = None):
    """PEFT's model of the run's adapters with the trained values in: on the base weights of `base` (for a merge,
    loaded in fp32), else on the meta device (nothing of the base is needed to write adapters). Its
    base_model_name_or_path is `base_name`, else the run's --model as the checkpoint recorded it. Every parameter
    PEFT trains must receive a value (tied copies share one)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = os.path.join(checkpoint, "model")
    with open(os.path.join(folder, ADAPTER_MODULES)) as f:
        saved = json.load(f)["saved"]
    lora = LoraConfig.from_pretrained(folder)
    recorded = lora.base_model_name_or_path  # get_peft_model puts the model's own name there
    with without_zero3():  # a checkpoint is written while the run's ZeRO-3 setting lives: this model is not the run's
        if base is not None:
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # merged in fp32, then cast
            peft = get_peft_model(model, lora, autocast_adapter_dtype=False)
        else:
            with torch.device("meta"):
                peft = get_peft_model(AutoModelForCausalLM.from_config(config), lora, autocast_adapter_dtype=False)
    peft.peft_config["default"].base_model_name_or_path = base_name or recorded
    params = dict(peft.named_parameters(remove_duplicate=False))
    by_tensor = {}
    for name, value in trained.items():
        target = peft_name(name, saved)
        if target in params:
            by_tensor[id(params[target])] = value
    values = {n: by_tensor[id(p)] for n, p in params.items() if id(p) in by_tensor}
    missing = sorted(n for n, p in params.items() if p.requires_grad and n not in values)
    if missing:
        raise CheckpointError(f"{checkpoint} lacks trained values of {missing[:5]}: it does not match its "
                              f"adapter_config.json")
    peft.load_state_dict(values, strict=False, assign=base is None)
    return peft


def write_adapter_folder(checkpoint: str, out: str, trained: dict, dtype: torch.dtype = torch.float32,
                         base_name: Optional[str] = None) -> None:
    """adapter_config.json and adapter_model.safetensors of `checkpoint` (a --use_peft checkpoint folder, complete
    or being written; `trained`: its consolidated state, {our name: value}) into `out`, the values in `dtype`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(os.path.join(checkpoint, "model"))
    peft = peft_model(checkpoint, config, None, trained, base_name)
    for p in peft.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype)
    peft.save_pretrained(out, save_embedding_layers=False)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(out, name)):
            raise CheckpointError(f"PEFT wrote no {name} into {out}")
