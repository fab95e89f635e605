"""Export a training checkpoint to a Hugging Face model folder (safetensors, config, tokenizer).

    python -m ulysses_train.export CHECKPOINT OUT [--dtype auto|bf16|fp32]
    python -m ulysses_train.export CHECKPOINT OUT [--merge [--base_model PATH]]     # a --use_peft run's

Exit code 2, with the reason, when nothing could be exported. What is written: train/checkpoints/export_model.py
(its docstring follows in --help)."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from ..train.checkpoints import export_model
from ..train.checkpoints.checkpoint import CheckpointError
from ..train.checkpoints.export_model import export


def main(argv=None) -> int:
    what = export_model.__doc__.split("\n\n", 1)[1]  # after its first paragraph, which names this command
    parser = argparse.ArgumentParser(prog="python -m ulysses_train.export", description=f"{__doc__}\n\n{what}",
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
