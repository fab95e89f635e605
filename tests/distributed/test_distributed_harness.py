"""The multi-process harness itself: a failing rank fails the call with its traceback instead of hanging the
others. That results come back in rank order is checked in a launch made anyway (the `sharded` fixture of
tests/distributed/test_attention_equivalence.py) rather than in a launch of its own."""

import pytest

from tests.multiprocess import run_distributed


def _boom(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank

def test_error_reported():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_boom, 2)
