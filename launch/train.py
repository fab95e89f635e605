"""Entry point: `deepspeed launch/train.py --ds_config ds_configs/zero3.json [flags]` (also torchrun, accelerate
launch, srun or plain python). The command line lives in ulysses_train/train/cli.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_train.train.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
