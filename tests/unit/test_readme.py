"""The standalone snippet of docs/own-loop.md runs as written (2 gloo ranks), its SP=2 loss equals the SP=1 loss, and it
ends cleanly: no gloo worker thread is left once it has called destroy_process_group()."""

import os
import re
import subprocess
import sys

import pytest

from tests.trainer_runs import ROOT, child_env, launch_port

# run after the snippet: its rank's gloo threads (pt_gloo_runloop, gloo_tcp_loop) still alive. A group that outlives
# destroy_process_group() goes into interpreter exit with them, where rank 1 aborted about one run in two
# (`terminate called without an active exception`, exit -6): ulysses_train held its groups strongly, and
# torch.distributed.nn imported after init_process_group held the default group (sp/groups.py)
THREADS_LEFT = """
import glob as _glob
_names = [open(_p).read().strip() for _p in _glob.glob("/proc/self/task/*/comm")]
print(f"gloo threads left: {sum(_n.startswith(('pt_gloo', 'gloo_')) for _n in _names)}", flush=True)
"""


def _snippet() -> str:
    page = open(os.path.join(ROOT, "docs", "own-loop.md")).read()
    return re.search(r"<!-- standalone-example -->\s*```python\n(.*?)```", page, re.S).group(1)


@pytest.mark.slow
def test_readme_snippet_runs_and_matches_one_process(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_snippet() + THREADS_LEFT)
    losses = {}
    for n in (1, 2):
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
                              "--master_port", str(launch_port()), str(script)], cwd=ROOT, env=child_env(),
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        losses[n] = sorted(set(re.findall(r"loss (\d+\.\d+)", out.stdout)))
        assert re.findall(r"gloo threads left: (\d+)", out.stdout) == ["0"] * n, out.stdout[-2000:]
    assert len(losses[2]) == 1 and losses[2] == losses[1]  # both ranks agree, and equal one process
