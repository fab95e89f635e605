"""The environment a run's processes start with (train/api.py: PROCESS_DEFAULTS), each value kept where the user
set one."""

from ulysses_train.train.api import PROCESS_DEFAULTS, process_defaults


def test_defaults_are_set_and_a_users_own_value_stays(monkeypatch):
    import os

    for name in PROCESS_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    process_defaults()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")
    process_defaults()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:native"
