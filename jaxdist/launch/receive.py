"""Bounded receipt of gRPC request bodies: what an unauthenticated caller may hold of a server.

gRPC's Python server gives a handler thread to every call as soon as its headers arrive; a
caller that then sends its message slowly, or never, holds that thread. A server that reads its
requests as a stream through a :class:`Receiver` bounds that: how long a body may stall between
chunks and take in all, how many bodies one peer host may have arriving slowly at once, and how
many calls may be receiving at once (so that some handler threads are always free for honest
callers, whose bodies arrive with their headers). The parameter servers' transport
(:mod:`jaxdist.ps.transport`) uses it; the elastic agents' rendezvous store
(:mod:`jaxdist.launch.rendezvous`) is served by ``grpc.aio`` instead, where a call waiting for its
body holds no thread at all.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Full(Exception):
    """Too many calls are receiving their bodies; this one is refused before its body."""


class Cancelled(Exception):
    """The call ended (its caller or the watchdog cancelled it) while its body was arriving."""


@dataclasses.dataclass(frozen=True)
class ReceiveLimits:
    """How long and how many handler threads a request body may take.

    Attributes:
      chunk_timeout_s: longest wait for the next chunk of a body; a stalled body is cancelled.
      body_timeout_s: longest a whole body may take to arrive.
      slow_after_s: a body still arriving after this long counts as slow.
      max_slow_per_peer: most slow bodies one peer host may have arriving at once; one more is
        cancelled.
      max_receiving: most calls of the server receiving their bodies at once; one more is refused
        (after waiting up to ``2 x slow_after_s`` for a place) so that they never hold every
        handler thread.

    >>> ReceiveLimits(chunk_timeout_s=float("nan"))
    Traceback (most recent call last):
    ValueError: ReceiveLimits.chunk_timeout_s = nan: expected a finite number in (0, 1e6]
    """

    chunk_timeout_s: float = 10.0
    body_timeout_s: float = 300.0
    slow_after_s: float = 0.5
    max_slow_per_peer: int = 8
    max_receiving: int = 16

    def __post_init__(self):
        for name in ("chunk_timeout_s", "body_timeout_s", "slow_after_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and 0 < v <= 1e6):
                raise ValueError(f"ReceiveLimits.{name} = {v!r}: expected a finite number in "
                                 "(0, 1e6]")
        for name in ("max_slow_per_peer", "max_receiving"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ReceiveLimits.{name} = {v!r}: expected a whole number >= 1")


class Receipt:
    """One call receiving its body: the watchdog's view of it (``last``: its last chunk)."""

    __slots__ = ("context", "host", "start", "last", "slow")

    def __init__(self, context, host: str):
        self.context, self.host = context, host
        self.start = self.last = time.monotonic()
        self.slow = False


class Receiver:
    """Reads request bodies under :class:`ReceiveLimits`; one watchdog thread cancels the calls
    whose bodies stall, take too long, or are slow beyond a peer's share."""

    def __init__(self, limits: ReceiveLimits, *, name: str = "receive-watch"):
        self.limits = limits
        self._lock = threading.Condition()
        self._active: set[Receipt] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name=name)
        self._thread.start()
        self.cancelled = 0  # calls cut by the watchdog (for tests and status)

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        lim = self.limits
        while not self._stop.wait(0.05):
            now = time.monotonic()
            cut = []
            with self._lock:
                slow: dict[str, int] = {}
                for r in self._active:
                    slow[r.host] = slow.get(r.host, 0) + r.slow
                for r in sorted(self._active, key=lambda r: r.start):
                    if (now - r.last > lim.chunk_timeout_s
                            or now - r.start > lim.body_timeout_s):
                        cut.append(r)
                    elif not r.slow and now - r.start > lim.slow_after_s:
                        if slow.get(r.host, 0) >= lim.max_slow_per_peer:
                            cut.append(r)
                        else:
                            r.slow = True
                            slow[r.host] = slow.get(r.host, 0) + 1
                for r in cut:
                    self._active.discard(r)
                self.cancelled += len(cut)
                if cut:
                    self._lock.notify(len(cut))
            for r in cut:
                logger.warning("cancelling a call from %s whose request body is stalled or too "
                               "slow (%.1fs)", r.host, now - r.start)
                r.context.cancel()

    def read(self, requests, context, assemble: Callable[[Any, Receipt], Any]) -> Any:
        """``assemble(requests, receipt)`` (which sets ``receipt.last`` at each chunk), under
        the limits.

        Raises:
          Full: too many calls are receiving.
          Cancelled: the call was cancelled (by its caller or the watchdog).
        """
        peer = context.peer() or "unknown"
        receipt = Receipt(context, peer.rsplit(":", 1)[0])
        with self._lock:
            # a full house frees within slow_after_s (the watchdog cuts slow bodies past a
            # peer's share), so an honest call waits that long before it is refused
            if not self._lock.wait_for(lambda: len(self._active) < self.limits.max_receiving,
                                       self.limits.slow_after_s * 2):
                raise Full(f"{len(self._active)} calls are already sending their requests to "
                           "this server (ReceiveLimits.max_receiving); retry later")
            self._active.add(receipt)
        try:
            body = assemble(requests, receipt)
        finally:
            with self._lock:
                self._active.discard(receipt)
                self._lock.notify()
        if context is not None and not context.is_active():
            raise Cancelled()
        return body
