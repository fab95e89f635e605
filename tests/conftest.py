import os
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# hermetic: the tests (and the trainers they launch, which inherit the environment) never share the user's
# datasets cache, nor another test session's
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="ulysses-test-datasets-")
# without a GPU, Triton's interpreter runs our fused kernels on CPU tensors (tests/unit/test_fused_kernels.py); it
# must be set before the kernels are defined, and the processes the tests start inherit it
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the probe suite's profiles (tests/unit/test_probes.py): few examples in the quick loop, more in CI. No deadline: an
# example's time depends on the machine's load, and the tests put no time limit on anything
from hypothesis import settings  # noqa: E402

settings.register_profile("quick", max_examples=15, deadline=None)
settings.register_profile("ci", max_examples=100, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") == "true" else "quick"))


# the tests by cost: tests/unit runs in this process (a few are marked slow), tests/distributed starts processes
# (gloo ranks, launched runs: every test there is slow), tests/gpu needs a CUDA GPU (slow too)
FOLDER_MARKS = {"distributed": ("slow",), "gpu": ("gpu", "slow")}


_CONFIG = []  # pytest's config, for the terminal reporter


def pytest_configure(config):
    _CONFIG.append(config)
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one (every test in tests/gpu)")
    config.addinivalue_line("markers", "slow: starts processes or trains for seconds (every test in tests/distributed "
                                       "and tests/gpu, and those so marked in tests/unit); -m 'not slow' is the "
                                       "quick loop")


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        folder = os.path.basename(os.path.dirname(str(item.fspath)))
        for mark in FOLDER_MARKS.get(folder, ()):
            item.add_marker(getattr(pytest.mark, mark))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """A GPU test's failure, printed the moment it comes (in the main process under xdist too): a command on the
    lent GPU machine has a time limit that can end the session before pytest's summary, and the reason with it.
    Through the terminal reporter: pytest captures the process's own stderr at that point."""
    if report.failed and "gpu" in report.keywords and _CONFIG:
        reporter = _CONFIG[0].pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"FAILED NOW {report.nodeid} ({report.when}):\n{report.longreprtext[-4000:]}")
