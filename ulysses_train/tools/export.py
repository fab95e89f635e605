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
import sys

from ..errors import ConfigError
from ..train.checkpoints.checkpoint import CheckpointError
from ..train.checkpoints.export_model import export


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
                        help="the base weights the adapters were trained on (default: the run's --model)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT when it is a folder that holds files")
    args = parser.parse_args(argv)
    try:
        print(f"exported to "
              f"{export(args.checkpoint, args.out, args.dtype, args.merge, args.base_model, args.overwrite)}")
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
