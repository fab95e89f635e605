"""A training checkpoint as a Hugging Face model folder: what `python -m ulysses_train.export` (tools/export.py) and
`Trainer.save_model` write.

A --use_peft checkpoint (adapters and the modules trained whole) exports as a PEFT adapter folder
(adapter_config.json and adapter_model.safetensors, written by PEFT's own save_pretrained; load it with
`PeftModel.from_pretrained(base, OUT)`), or with --merge as a whole model: the base weights (the run's --model, or
--base_model) with the adapters merged in by PEFT's `merge_and_unload`, loadable by `from_pretrained` alone. A QLoRA
run's adapters merge into the unquantized base.

CHECKPOINT is a `step_N` folder (or an output_dir, whose newest intact checkpoint is used), checked against its
manifest first. OUT must be a folder or a path that does not exist yet. The ZeRO-3 shards are consolidated on the
CPU with DeepSpeed's zero_to_fp32 (loaded with weights_only=True), the `model.` prefix of the trainer's wrapper is
dropped, and `save_pretrained` writes safetensors."""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from typing import Optional

import torch

from ...errors import ConfigError
from ...model.adapters import ADAPTER_CONFIG
from ...model.peft_files import peft_model, write_adapter_folder
from .checkpoint import COMPLETE, CheckpointError, consolidated_state, resolve_resume
from .manifest import verify_checkpoint


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def export(checkpoint: str, out: str, dtype: str = "auto", merge: bool = False, base_model: Optional[str] = None,
           overwrite: bool = False) -> str:
    """The checkpoint as a model (or adapter) folder at `out`, written into a temporary folder beside it and renamed
    into place: a failed export leaves `out` as it was. A folder that holds anything is replaced only with
    `overwrite`."""
    from transformers import AutoConfig

    _check_out(out, overwrite)
    if not os.path.exists(os.path.join(checkpoint, COMPLETE)):
        checkpoint = resolve_resume("auto", checkpoint, _warn) or checkpoint
    if not os.path.exists(os.path.join(checkpoint, COMPLETE)):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint (nor an output_dir that holds one)")
    verify_checkpoint(checkpoint)
    state = consolidated_state(checkpoint)
    config = AutoConfig.from_pretrained(os.path.join(checkpoint, "model"))
    adapters = os.path.exists(os.path.join(checkpoint, "model", ADAPTER_CONFIG))
    if not adapters and (merge or base_model):
        raise ConfigError(f"--merge and --base_model export adapters: {checkpoint} was trained without --use_peft "
                          f"(it holds every weight; export it without them)")
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.normpath(out))}.export-",
                           dir=os.path.dirname(os.path.abspath(out)))
    try:
        if adapters:
            export_adapters(checkpoint, state, config, tmp, dtype, merge, base_model)
        else:
            _export_model(checkpoint, state, config, tmp, _dtype(dtype, config))
        _copy_tokenizer(checkpoint, tmp)
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _dtype(name: str, config) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32}.get(name) or config.dtype or torch.float32


def _check_out(out: str, overwrite: bool) -> None:
    """OUT is a path that does not exist, an empty folder, or (with --overwrite) a folder to replace."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"OUT {out} is a file: give a folder to write the model into")
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(f"OUT {out} is not empty ({shown}): give a new folder, or --overwrite to replace it "
                          f"whole")


def _replace(tmp: str, out: str) -> None:
    """Renames the finished export into place; an existing `out` (checked by _check_out) is moved aside first and
    removed only once the new one is there."""
    aside = None
    if os.path.exists(out):
        aside = f"{tmp}.old"
        os.replace(out, aside)
    os.replace(tmp, out)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _export_model(checkpoint: str, state: dict, config, out: str, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise CheckpointError(f"checkpoint does not match the model: missing {sorted(set(missing) - tied)}, "
                              f"unexpected {sorted(unexpected)}")
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    if not os.path.isfile(os.path.join(out, "config.json")):
        raise CheckpointError(f"nothing was written to {out}")


def _copy_tokenizer(checkpoint: str, out: str) -> None:
    from transformers import AutoTokenizer

    if os.path.exists(os.path.join(checkpoint, "model", "tokenizer_config.json")):
        AutoTokenizer.from_pretrained(os.path.join(checkpoint, "model")).save_pretrained(out)
    else:
        print("note: no tokenizer in the checkpoint (generated tokens or --tokenizer bytes); config and weights "
              "exported", file=sys.stderr)


def export_adapters(checkpoint: str, trained: dict, config, out: str, dtype: str, merge: bool,
                    base_model: Optional[str]) -> None:
    """A PEFT adapter folder, or with `merge` a whole model with the adapters merged (module docstring)."""
    from peft import LoraConfig

    from ...paths import local_or_hub

    base = base_model or LoraConfig.from_pretrained(os.path.join(checkpoint, "model")).base_model_name_or_path
    if not base:
        what = "--merge needs the base weights" if merge else "an adapter folder is loaded onto its base weights"
        raise ConfigError(f"{what}, and {checkpoint} was trained on a random initialisation (no --model), whose "
                          f"weights were never saved: give --base_model PATH (a model folder of those weights), or "
                          f"train from a --model folder")
    local_or_hub("base_model", base)
    if not merge:
        write_adapter_folder(checkpoint, out, trained, _dtype(dtype, config), base)
        return
    peft = peft_model(checkpoint, config, base, trained)  # base and adapters in fp32
    merged = peft.merge_and_unload()
    target = _merged_dtype(dtype, config, peft, merged)
    merged.to(target).save_pretrained(out, safe_serialization=True)
    if not os.path.isfile(os.path.join(out, "config.json")):
        raise CheckpointError(f"nothing was written to {out}")


def _merged_dtype(dtype: str, config, peft, merged) -> torch.dtype:
    """The merge's output dtype. The merge is computed in fp32 and cast once; a cast to bf16 rounds each merged
    weight to 8 bits, which loses an adapter update smaller than the weight's rounding step. So the loss is
    measured (lost_update_share) and said: `auto` keeps fp32 when the cast would lose over a tenth of the update,
    an explicit --dtype bf16 warns with the share."""
    target = _dtype(dtype, config)
    if target == torch.float32:
        return target
    lost = lost_update_share(peft, merged, target)
    if lost <= 0.1:
        return target
    if dtype == "auto":
        _note(f"the merged weights stay fp32: in {str(target).removeprefix('torch.')} they would lose "
              f"{lost:.0%} of the adapters' update to rounding (pass --dtype bf16 to cast them anyway)")
        return torch.float32
    _warn(f"--dtype bf16 rounds away {lost:.0%} of the adapters' update in the merged weights (--dtype fp32 keeps "
          f"it)")
    return target


def lost_update_share(peft, merged, dtype: torch.dtype) -> float:
    """||cast(W + dW) - (W + dW)|| / ||dW|| over the merged layers: the part of the adapters' update dW that the
    cast to `dtype` does not keep (0: all of it kept)."""
    lost = update = 0.0
    with torch.no_grad():
        for name, module in peft.named_modules():
            if not hasattr(module, "get_delta_weight") or "default" not in getattr(module, "lora_A", {}):
                continue
            delta = module.get_delta_weight("default").float()
            weight = merged.get_submodule(name.removeprefix("base_model.model.")).weight.float()
            lost += (weight.to(dtype).float() - weight).square().sum().item()
            update += delta.square().sum().item()
    return math.sqrt(lost / update) if update > 0 else 0.0


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)
