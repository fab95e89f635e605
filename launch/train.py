"""`deepspeed launch/train.py --ds_config ds_configs/zero3.json [flags]` (also torchrun, accelerate launch, srun or
plain python): the trainer's command line (ulysses_train/train/cli.py) as a script path for the launchers that take
one. The installed package also has it as the `ulysses-train` command. It imports the package as installed by
`pip install -e .` (README); it does not edit sys.path."""

import sys

try:
    from ulysses_train.train.cli import main
except ModuleNotFoundError as e:
    if e.name != "ulysses_train":
        raise
    sys.exit("error: the ulysses_train package is not installed: run `pip install -e .` in the repository (README)")

if __name__ == "__main__":
    sys.exit(main())
