"""The README's standalone snippet runs as written (2 gloo ranks) and its SP=2 loss equals the SP=1 loss."""

import os
import re
import subprocess
import sys

from tests.test_train_e2e import ROOT, _env, _port


def _snippet() -> str:
    readme = open(os.path.join(ROOT, "README.md")).read()
    return re.search(r"<!-- standalone-example -->\s*```python\n(.*?)```", readme, re.S).group(1)


def test_readme_snippet_runs_and_matches_one_process(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(_snippet())
    losses = {}
    for n in (1, 2):
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
                              "--master_port", str(_port()), str(script)], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        losses[n] = sorted(set(re.findall(r"loss (\d+\.\d+)", out.stdout)))
    assert len(losses[2]) == 1 and losses[2] == losses[1]  # both ranks agree, and equal one process
