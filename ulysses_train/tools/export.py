"""Export a training checkpoint to a Hugging Face model folder (safetensors, config, tokenizer).

    python -m ulysses_train.export CHECKPOINT OUT [--dtype auto|bf16|fp32]

CHECKPOINT is a `step_N` folder (or an output_dir, whose newest intact checkpoint is used), checked against its
manifest first. OUT must be a folder or a path that does not exist yet. The ZeRO-3 shards are consolidated on the
CPU with DeepSpeed's zero_to_fp32 (loaded with weights_only=True), the `model.` prefix of the trainer's wrapper is
dropped, and `save_pretrained` writes safetensors. Exit code 2, with the reason, when nothing could be exported."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..errors import ConfigError
from ..train.checkpoint import COMPLETE, CheckpointError, resolve_resume, safe_loading
from ..train.manifest import verify_checkpoint


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def export(checkpoint: str, out: str, dtype: str = "auto") -> str:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

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
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise CheckpointError(f"checkpoint does not match the model: missing {sorted(set(missing) - tied)}, "
                              f"unexpected {sorted(unexpected)}")
    model.to(torch_dtype).save_pretrained(out, safe_serialization=True)
    if not os.path.isfile(os.path.join(out, "config.json")):
        raise CheckpointError(f"nothing was written to {out}")
    if os.path.exists(os.path.join(checkpoint, "model", "tokenizer_config.json")):
        AutoTokenizer.from_pretrained(os.path.join(checkpoint, "model")).save_pretrained(out)
    else:
        print("note: no tokenizer in the checkpoint (generated tokens or --tokenizer bytes); config and weights "
              "exported", file=sys.stderr)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ulysses_train.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    args = parser.parse_args(argv)
    try:
        print(f"exported to {export(args.checkpoint, args.out, args.dtype)}")
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
