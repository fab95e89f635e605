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
