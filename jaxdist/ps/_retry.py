"""One retry-until-deadline helper for every "the peer is not there yet" loop in the package."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["retry"]

T = TypeVar("T")


def retry(fn: Callable[[float], T], /, *, timeout_s: float | None,
          retry_on: type[BaseException] | tuple[type[BaseException], ...],
          initial_delay_s: float = 0.05, max_delay_s: float = 1.0) -> T:
    """Calls ``fn(remaining_s)`` until it returns, retrying on ``retry_on`` with exponential
    backoff until ``timeout_s`` seconds have passed; then the last error propagates.

    ``fn`` receives the seconds left (``inf`` without a timeout) so it can bound its own wait.

    Args:
      fn: the attempt.
      timeout_s: overall deadline in seconds (None: retry forever; use with care).
      retry_on: exception type(s) that mean "try again".
      initial_delay_s, max_delay_s: backoff between attempts (doubling, capped).

    Returns:
      What ``fn`` returned.

    Raises:
      Whatever ``fn`` raised last once the deadline passed, and anything not in ``retry_on``
      at once.

    >>> calls = []
    >>> def flaky(left):
    ...     calls.append(left)
    ...     if len(calls) < 3:
    ...         raise ConnectionError("not yet")
    ...     return "up"
    >>> retry(flaky, timeout_s=5, retry_on=ConnectionError, initial_delay_s=0.001), len(calls)
    ('up', 3)
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    delay = initial_delay_s
    while True:
        left = float("inf") if deadline is None else deadline - time.monotonic()
        try:
            return fn(max(left, 0.0))
        except retry_on:
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, max_delay_s)
