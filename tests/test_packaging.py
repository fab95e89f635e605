"""What `pip install .` ships: every folder of the package that holds code is a package setup.py finds, so a
non-editable install imports as the checkout does."""

import os

from setuptools import find_packages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
