"""The GPU tests' memory ledger (tests/gpu/gpu_share.py), on the CPU: a run waits while the runs beside it hold too
much, and not for a run whose process has gone."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.gpu.gpu_share import _locked, gpu_share

ROOT = Path(__file__).resolve().parents[2]
HOLDER = """
import sys, time
from pathlib import Path
from tests.gpu.gpu_share import _locked, gpu_share
with gpu_share(60, capacity=100, ledger=Path(sys.argv[1])):
    Path(sys.argv[2]).write_text("held")
    time.sleep(2)
    print(time.time())  # the last moment it holds its share
"""


def test_a_run_waits_until_the_one_beside_leaves_room(tmp_path):
    ledger, held = tmp_path / "ledger.json", tmp_path / "held"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(ledger), str(held)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    while not held.exists():
        assert holder.poll() is None, "the holding process ended before it held its share"
        time.sleep(0.05)
    with gpu_share(30, capacity=100, ledger=ledger):  # fits beside the 60 held: no wait
        assert sorted(json.loads(ledger.read_text()).values()) == [30, 60]
    with gpu_share(50, capacity=100, ledger=ledger):  # does not fit beside them: waits for the holder to leave
        entered = time.time()
        assert list(json.loads(ledger.read_text()).values()) == [50]
    out, _ = holder.communicate()
    assert holder.returncode == 0 and entered >= float(out)
    assert json.loads(ledger.read_text()) == {}


def test_a_gone_process_holds_nothing(tmp_path):
    ledger = tmp_path / "ledger.json"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ledger.write_text(json.dumps({gone.stdout.strip(): 90, str(os.getpid()): 5}))
    with _locked(ledger) as held:
        assert held == {str(os.getpid()): 5}


def test_a_run_larger_than_the_gpu_runs_alone(tmp_path, capsys):
    ledger = tmp_path / "ledger.json"
    with gpu_share(150, capacity=100, ledger=ledger, what="large"):
        assert list(json.loads(ledger.read_text()).values()) == [150]
    assert "waited" not in capsys.readouterr().out  # entered at first asking
