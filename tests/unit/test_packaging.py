"""What `pip install .` ships: every folder of the package that holds code is a package setup.py finds, so a
non-editable install imports as the checkout does."""

import os

from setuptools import find_packages

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def test_every_code_folder_is_an_installed_package():
    found = set(find_packages(where=ROOT, include=["ulysses_train", "ulysses_train.*"]))
    package = os.path.join(ROOT, "ulysses_train")
    folders = {os.path.relpath(d, ROOT).replace(os.sep, ".") for d, _, files in os.walk(package)
               if any(f.endswith(".py") for f in files) and "__pycache__" not in d}
    assert folders and folders <= found, sorted(folders - found)


def test_imports_and_resolves_the_loss_without_liger_kernel():
    """liger-kernel is a dependency on Linux only and is imported where its loss runs: with it blocked, the package,
    the trainer and the planner import, a CUDA device resolves `--loss_kernel auto` to ours and says why, and the
    self-check names the missing package (what `--loss_kernel liger` then stops with)."""
    import subprocess
    import sys

    code = """
import sys
sys.modules["liger_kernel"] = None  # any import of it fails
import torch
import ulysses_train, ulysses_train.train.run.trainer, ulysses_train.tools.plan
from ulysses_train.levers.loss import liger_check
from ulysses_train.levers.policy import DeviceInfo, LeverRequest, resolve_levers
from ulysses_train.model.build import load_model_config
from ulysses_train.model.geometry import geometry
device = DeviceInfo.of(torch.device("cpu"), 1)
assert not device.liger
gpu = DeviceInfo("cuda", 2**37, 2**37, liger=device.liger)
levers = resolve_levers(LeverRequest(), geometry(load_model_config(None, "tiny")), 1024, 2, gpu)
assert levers.loss_kernel == "ours" and "not installed" in levers.why["loss_kernel"], levers
assert "not installed" in liger_check(torch.device("cuda"), torch.float32)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_console_scripts_are_the_tools_mains():
    """setup.py's commands (ulysses-train, -plan, -export, -preview) each name a `main(argv=None) -> int` that
    parses its own flags: `--help` prints the tool's usage under the command's name and exits 0."""
    import ast
    import contextlib
    import importlib
    import io

    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    scripts = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                   and node.targets[0].id == "CONSOLE_SCRIPTS")
    assert [s.split(" = ")[0] for s in scripts] == ["ulysses-train", "ulysses-plan", "ulysses-export",
                                                    "ulysses-preview"]
    for script in scripts:
        name, target = script.split(" = ")
        module, function = target.split(":")
        if name == "ulysses-train":  # its main ends the process (exit codes for every rank: train/cli.py)
            import subprocess
            import sys

            code = f"from {module} import {function}; {function}(['--help'])"
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
            assert done.returncode == 0 and "usage:" in done.stdout, (name, done.stderr[-1000:])
            continue
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                getattr(importlib.import_module(module), function)(["--help"])
        except SystemExit as e:  # argparse's --help
            assert e.code in (None, 0), (name, e.code)
        assert "usage:" in out.getvalue(), (name, out.getvalue()[-500:])


def test_the_launch_script_edits_no_path_and_names_the_install():
    """launch/train.py imports the installed package; without it, one line says what to install."""
    import subprocess
    import sys

    script = os.path.join(ROOT, "launch", "train.py")
    assert "sys.path" not in open(script).read().split('"""')[-1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    isolated = subprocess.run([sys.executable, "-S", script, "--help"], capture_output=True, text=True, env=env,
                              cwd=os.path.dirname(ROOT))
    assert isolated.returncode == 1 and "pip install -e ." in isolated.stderr, isolated.stderr[-1000:]
