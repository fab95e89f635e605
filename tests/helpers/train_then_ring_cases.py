"""Run under torchrun: train with the real Trainer (flags from argv, as launch/train.py runs them), then, on the
same processes, run the hybrid attention cases of tests/ring_cases.py (`CASES_8`) and save each rank's results to
$RING_CASES_OUT/<rank>.pt. One launch of 8 processes serves both checks (8-process runs are the slow ones on CPU)."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.ring_cases import CASES_8, run_cases  # noqa: E402
from ulysses_train.train.config.config_file import parse_args  # noqa: E402
from ulysses_train.train.process.launcher import exit_now, normalise_launcher_env  # noqa: E402
from ulysses_train.train.run.trainer import Trainer  # noqa: E402
from ulysses_train.train.step.loop import train  # noqa: E402

cfg, explicit = parse_args(sys.argv[1:])
normalise_launcher_env()
trainer = Trainer(cfg, explicit)
train(trainer)
torch.set_num_threads(1)
results = run_cases(trainer.rank, trainer.world, CASES_8)
torch.save(results, os.path.join(os.environ["RING_CASES_OUT"], f"{trainer.rank}.pt"))
dist.barrier()
# as launch/train.py ends: gloo's teardown of the sub-groups at interpreter exit now and then aborts a rank that
# has finished ("terminate called without an active exception"), destroy_process_group first or not
exit_now(0)
