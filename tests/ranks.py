"""A run's ranks started as plain processes with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), without a launcher.

For tests about the trainer rather than the launcher: DeepSpeed's launcher adds two Python processes that import
DeepSpeed before the ranks start (torchrun one), and no launcher is there to tear the ranks down, so every rank's own
exit code and output are seen. The launchers themselves are tested in tests/distributed/test_train_e2e.py,
tests/distributed/test_failures.py and tests/distributed/test_reliability.py. The 10-minute guard is a hang detector,
not a speed requirement."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tests.trainer_runs import ROOT, child_env, launch_port

HANG_GUARD_S = 600


@dataclass
class Ranks:
    """Every rank's exit code and output, in rank order."""

    codes: list[int]
    stdouts: list[str]
    stderrs: list[str]

    @property
    def returncode(self) -> int:
        """The first non-zero exit code in rank order, else 0."""
        return next((code for code in self.codes if code != 0), 0)

    @property
    def stdout(self) -> str:  # every rank's, rank 0's first (what a launcher's merged output holds)
        return "".join(self.stdouts)

    @property
    def stderr(self) -> str:
        return "".join(self.stderrs)


def run_ranks(world: int, args: list, env: dict | None = None) -> Ranks:
    """`python args...` as `world` ranks on this host; returns when every rank has exited."""
    port = str(launch_port())
    procs = [subprocess.Popen([sys.executable] + [str(a) for a in args], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=child_env() | (env or {}) | dict(RANK=str(r), WORLD_SIZE=str(world),
                                                             LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                                                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(world)]
    with ThreadPoolExecutor(world) as pool:  # every rank's pipes read at once: none blocks on a full one
        outputs = list(pool.map(lambda p: p.communicate(timeout=HANG_GUARD_S), procs))
    return Ranks([p.returncode for p in procs], [out for out, _ in outputs], [err for _, err in outputs])
