"""The multi-process harness itself: results come back in rank order, and a failing rank fails the call with its
traceback instead of hanging the others."""

import pytest
from tests.distributed import run_distributed

def _boom(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank

def test_error_reported():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_boom, 2)

def _ok(rank, world):
    return rank * 10

def test_ok():
    assert run_distributed(_ok, 2) == [0, 10]
