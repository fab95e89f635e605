"""Entry point: `deepspeed launch/train.py --ds_config ds_configs/zero3.json [flags]` (also torchrun, accelerate
launch, srun or plain python). The loop lives in ulysses_train.trainer."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_train.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
