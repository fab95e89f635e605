"""The environment a run's processes start with (train/api.py: PROCESS_DEFAULTS), each value kept where the user
set one."""

import pytest

from ulysses_train.train.api import PROCESS_DEFAULTS, process_defaults


def test_defaults_are_set_and_a_users_own_value_stays(monkeypatch):
    for name in PROCESS_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    process_defaults()
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"


def test_triton_reads_the_autotuning_cache_switch(monkeypatch):
    """The name is Triton's own knob: with it set, kernels autotuned from then on (FLA's, imported after the run
    starts) keep their timings on disk; a Triton that renamed it fails here."""
    triton = pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    assert not triton.knobs.autotuning.cache
    process_defaults()
    assert triton.knobs.autotuning.cache
