"""Export a training checkpoint to a Hugging Face model folder (safetensors, config, tokenizer).

    python -m ulysses_train.export CHECKPOINT OUT [--dtype auto|bf16|fp32]
    python -m ulysses_train.export CHECKPOINT OUT [--merge [--base_model PATH]]     # a --use_peft run's

A --use_peft checkpoint (adapters and the modules trained whole) exports as a PEFT adapter folder
(adapter_config.json and adapter_model.safetensors, written by PEFT's own save_pretrained; load it with
`PeftModel.from_pretrained(base, OUT)`), or with --merge as a whole model: the base weights (the run's --model, or
--base_model) with the adapters merged in by PEFT's `merge_and_unload`, loadable by `from_pretrained` alone. A QLoRA
run's adapters merge into the unquantized base.

CHECKPOINT is a `step_N` folder (or an output_dir, whose newest intact checkpoint is used), checked against its
manifest first. OUT must be a folder or a path that does not exist yet. The ZeRO-3 shards are consolidated on the
CPU with DeepSpeed's zero_to_fp32 (loaded with weights_only=True), the `model.` prefix of the trainer's wrapper is
dropped, and `save_pretrained` writes safetensors. Exit code 2, with the reason, when nothing could be exported."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

import torch

from ..errors import ConfigError
from ..model.adapters import ADAPTER_CONFIG, ADAPTER_MODULES, peft_name
from ..train.checkpoint import COMPLETE, CheckpointError, resolve_resume, safe_loading
from ..train.manifest import verify_checkpoint


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def export(checkpoint: str, out: str, dtype: str = "auto", merge: bool = False, base_model: Optional[str] = None
           ) -> str:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.exists(out) and not os.path.isdir(out):  # save_pretrained would only log it and write nothing
        raise ConfigError(f"OUT {out} is a file: give a folder to write the model into")
    if not os.path.exists(os.path.join(checkpoint, COMPLETE)):
        checkpoint = resolve_resume("auto", checkpoint, _warn) or checkpoint
    if not os.path.exists(os.path.join(checkpoint, COMPLETE)):
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint (nor an output_dir that holds one)")
    verify_checkpoint(checkpoint)
    with safe_loading():
        state = get_fp32_state_dict_from_zero_checkpoint(checkpoint, tag="ds")
    state = {k.removeprefix("model."): v for k, v in state.items()}
    config = AutoConfig.from_pretrained(os.path.join(checkpoint, "model"))
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype) or config.dtype or torch.float32
    if os.path.exists(os.path.join(checkpoint, "model", ADAPTER_CONFIG)):
        export_adapters(checkpoint, state, config, out, torch_dtype, merge, base_model)
        _copy_tokenizer(checkpoint, out)
        return out
    if merge or base_model:
        raise ConfigError(f"--merge and --base_model export adapters: {checkpoint} was trained without --use_peft "
                          f"(it holds every weight; export it without them)")
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise CheckpointError(f"checkpoint does not match the model: missing {sorted(set(missing) - tied)}, "
                              f"unexpected {sorted(unexpected)}")
    model.to(torch_dtype).save_pretrained(out, safe_serialization=True)
    if not os.path.isfile(os.path.join(out, "config.json")):
        raise CheckpointError(f"nothing was written to {out}")
    _copy_tokenizer(checkpoint, out)
    return out


def _copy_tokenizer(checkpoint: str, out: str) -> None:
    from transformers import AutoTokenizer

    if os.path.exists(os.path.join(checkpoint, "model", "tokenizer_config.json")):
        AutoTokenizer.from_pretrained(os.path.join(checkpoint, "model")).save_pretrained(out)
    else:
        print("note: no tokenizer in the checkpoint (generated tokens or --tokenizer bytes); config and weights "
              "exported", file=sys.stderr)


def _peft_model(checkpoint: str, config, base: Optional[str], trained: dict):
    """PEFT's model of the run's adapters with the trained values in: on the base weights of `base` (for a merge),
    else on the meta device (nothing of the base is needed to write adapters). Every parameter PEFT trains must
    receive a value (tied copies share one)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = os.path.join(checkpoint, "model")
    with open(os.path.join(folder, ADAPTER_MODULES)) as f:
        saved = json.load(f)["saved"]
    lora = LoraConfig.from_pretrained(folder)
    recorded = lora.base_model_name_or_path  # get_peft_model puts the model's own name there
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # merged in fp32, then cast
        peft = get_peft_model(model, lora, autocast_adapter_dtype=False)
    else:
        with torch.device("meta"):
            peft = get_peft_model(AutoModelForCausalLM.from_config(config), lora, autocast_adapter_dtype=False)
    peft.peft_config["default"].base_model_name_or_path = recorded  # the run's --model
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


def export_adapters(checkpoint: str, trained: dict, config, out: str, dtype: torch.dtype, merge: bool,
                    base_model: Optional[str]) -> None:
    """A PEFT adapter folder, or with `merge` a whole model with the adapters merged (module docstring)."""
    from peft import LoraConfig

    from ..paths import local_or_hub

    base = base_model or LoraConfig.from_pretrained(os.path.join(checkpoint, "model")).base_model_name_or_path
    if merge and not base:
        raise ConfigError(f"--merge needs the base weights, and {checkpoint} was trained on a random initialisation "
                          f"(no --model): give --base_model PATH")
    if merge:
        local_or_hub("base_model", base)
    peft = _peft_model(checkpoint, config, base if merge else None, trained)
    if merge:
        peft.merge_and_unload().to(dtype).save_pretrained(out, safe_serialization=True)
        written = "config.json"
    else:
        for p in peft.parameters():
            if p.requires_grad:
                p.data = p.data.to(dtype)
        peft.save_pretrained(out, save_embedding_layers=False)
        written = ADAPTER_CONFIG
    if not os.path.isfile(os.path.join(out, written)):
        raise CheckpointError(f"nothing was written to {out}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ulysses_train.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--merge", action="store_true",
                        help="a --use_peft checkpoint: write the base model with the adapters merged in, instead of "
                             "a PEFT adapter folder")
    parser.add_argument("--base_model", default=None,
                        help="with --merge: the base weights (default: the run's --model)")
    args = parser.parse_args(argv)
    try:
        print(f"exported to {export(args.checkpoint, args.out, args.dtype, args.merge, args.base_model)}")
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
