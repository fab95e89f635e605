"""docs/architecture.md's rule, checked on the source: imports point down (families < sp < levers < model < data <
train < tools), including the imports made inside functions; inside train/ its rooms follow a run's flow; and no
module of the package is in an import cycle. And in tests/: no file imports from a test module (`tests.test_*`);
what tests share lives in helper modules (tests/trainer_runs.py, tests/references.py, ...), so running or editing
one test file does not import or depend on another."""

import ast
import os

from tests.trainer_runs import ROOT

PACKAGE = os.path.join(ROOT, "ulysses_train")
TESTS = os.path.join(ROOT, "tests")
LAYERS = {"errors": 0, "paths": 0, "families": 0, "sp": 1, "levers": 2, "model": 3, "data": 4, "train": 5, "tools": 6}
# train/'s rooms in the order of a run's flow (ulysses_train/train/__init__.py): each imports only those before it
ROOMS = {"config": 0, "process": 1, "checkpoints": 2, "step": 3, "preference": 4, "run": 5, "verify": 6, "api": 7,
         "cli": 7}


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
    assert _layer("ulysses_train.train.run.trainer") == 5  # the rule is read from the real module names


def _room(module: str):
    parts = module.split(".")
    return ROOMS.get(parts[2]) if len(parts) > 2 and parts[:2] == ["ulysses_train", "train"] else None


def test_train_rooms_import_only_the_rooms_before_them():
    backward, unplaced = [], []
    for folder, _, files in os.walk(os.path.join(PACKAGE, "train")):
        for path in (os.path.join(folder, n) for n in files if n.endswith(".py")):
            source = _module(path)
            if _room(source) is None and source != "ulysses_train.train":
                unplaced.append(source)
            backward += [f"{source} -> {t}" for t in _imports(path)
                         if None not in (_room(source), _room(t)) and _room(t) > _room(source)]
    assert not unplaced, "modules of train/ outside its rooms (ROOMS here, ulysses_train/train/__init__.py):\n" + \
        "\n".join(sorted(unplaced))
    assert not backward, "train/ rooms importing a later room:\n" + "\n".join(sorted(backward))
    assert _room("ulysses_train.train.run.trainer") == 5  # the rule is read from the real module names


def _module_graph() -> dict:
    """Each module of the package -> the modules it imports anywhere in it (function-level and TYPE_CHECKING
    imports included: a cycle through them still ties the two modules together)."""
    paths = {}
    for folder, _, files in os.walk(PACKAGE):
        paths.update({_module(os.path.join(folder, n)): os.path.join(folder, n) for n in files if n.endswith(".py")})

    def owner(target: str):
        while target and target not in paths:
            target = target.rpartition(".")[0]
        return target or None

    return {m: {owner(t) for t in _imports(p)} - {None, m} for m, p in paths.items()}


def import_cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start), on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt), on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_no_import_cycle_between_modules():
    cycles = import_cycles(_module_graph())
    assert not cycles, "import cycles (break them: docs/architecture.md):\n" + "\n".join(" <-> ".join(c)
                                                                                         for c in cycles)


def test_the_cycle_finder_finds_cycles():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def _from_test_module(target: str) -> bool:
    parts = target.split(".")
    return parts[0] == "tests" and any(part.startswith("test_") for part in parts[1:])


def test_no_test_module_imports_from_another():
    shared = []
    for folder, _, files in os.walk(TESTS):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                shared += [f"{os.path.relpath(path, ROOT)} -> {t}" for t in _imports(path) if _from_test_module(t)]
    assert not shared, "imports from test modules (move the helper into a tests/ helper module):\n" + "\n".join(
        sorted(shared))
    assert _from_test_module("tests.distributed.test_ring.CASES_8")
    assert not _from_test_module("tests.ring_cases.CASES_8")


def test_docs_architecture_names_every_module():
    """docs/architecture.md's listing stays true: every module of the package is named there (by its file name)."""
    page = open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8").read()
    unnamed = [os.path.relpath(os.path.join(folder, name), PACKAGE) for folder, _, files in os.walk(PACKAGE)
               for name in files if name.endswith(".py") and name != "__init__.py" and name not in page]
    assert not unnamed, "modules docs/architecture.md does not name:\n" + "\n".join(sorted(unnamed))
