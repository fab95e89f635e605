"""A time limit on a block of Python code that might never end or wait for ever: a chat template of nested loops
(rendered once per row), a tracker's first call to a server that does not answer.

`with deadline(seconds): ...` raises DeadlineExceeded inside the block when the time is up. It is a real-time
timer (`setitimer(ITIMER_REAL)`) whose SIGALRM handler raises: Python runs the handler between bytecodes, and a
blocking system call (a socket connect, a sleep between retries) is interrupted by it, so both a busy loop and a
wait end on time. Signals reach only the main thread: elsewhere (a thread of the caller's) the block runs without a
limit. Blocks do not nest: an inner one runs without a limit of its own while an outer one runs.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class DeadlineExceeded(BaseException):
    """The block ran past its deadline; the message says how long it was given. A BaseException, as
    KeyboardInterrupt is, so that the `except Exception` of the code in the block (a client's retry loop) does not
    swallow it."""


_active = threading.local()


@contextlib.contextmanager
def deadline(seconds: float):
    """Raises DeadlineExceeded in the block after `seconds` (module docstring)."""
    if threading.current_thread() is not threading.main_thread() or getattr(_active, "on", False) or seconds <= 0:
        yield
        return

    finished = False

    def expire(signum, frame):
        if not finished:  # not when the block ended just before the timer was cancelled
            raise DeadlineExceeded(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    _active.on = True
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        finished = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _active.on = False
