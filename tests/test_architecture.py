"""docs/architecture.md's rule, checked on the source: imports point down (families < sp < levers < model < data <
train < tools), including the imports made inside functions, so no package imports one above it and there is no
import cycle between packages. And in tests/: no file imports from a test module (`tests.test_*`); what tests share lives in
helper modules (tests/trainer_runs.py, tests/references.py, ...), so running or editing one test file does not
import or depend on another."""

import ast
import os

from tests.trainer_runs import ROOT

PACKAGE = os.path.join(ROOT, "ulysses_train")
TESTS = os.path.join(ROOT, "tests")
LAYERS = {"errors": 0, "paths": 0, "families": 0, "sp": 1, "levers": 2, "model": 3, "data": 4, "train": 5, "tools": 6}


def _module(path: str) -> str:
    relative = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return relative.removesuffix(".__init__")


def _imports(path: str):
    """Every ulysses_train module (or name in one) that the file at `path` imports, anywhere in it."""
    module = _module(path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            yield from (f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def _layer(module: str):
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 2 and parts[0] == "ulysses_train" else None


def test_imports_point_down():
    upward = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            source = _module(path)
            for target in _imports(path):
                if _layer(source) is not None and _layer(target) is not None and _layer(target) > _layer(source):
                    upward.append(f"{source} -> {target}")
    assert not upward, "imports pointing up (docs/architecture.md):\n" + "\n".join(sorted(upward))
    assert _layer("ulysses_train.train.trainer") == 5  # the rule is read from the real module names


def _from_test_module(target: str) -> bool:
    parts = target.split(".")
    return len(parts) > 1 and parts[0] == "tests" and parts[1].startswith("test_")


def test_no_test_module_imports_from_another():
    shared = []
    for folder, _, files in os.walk(TESTS):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                shared += [f"{os.path.relpath(path, ROOT)} -> {t}" for t in _imports(path) if _from_test_module(t)]
    assert not shared, "imports from test modules (move the helper into a tests/ helper module):\n" + "\n".join(
        sorted(shared))
    assert _from_test_module("tests.test_ring.CASES_8") and not _from_test_module("tests.ring_cases.CASES_8")
