"""Hang detection: a rank that completes no step for too long is declared hung.

Ranks report each completed step through a heartbeat file in the host's state directory (see
``jaxdist.memstate``); the launcher's agent reads them a few times a second. Once a rank has
reported its first step in an attempt, a rank (alive, not finished) whose last report is older
than the hang timeout is hung: a process stopped by SIGSTOP, a dead peer inside a collective that
never returns, a stuck data loader. The launcher then treats it as a failure (kills and re-forms).

The default timeout adapts to the job: ``min(300, max(60, 50 x median step time))`` seconds, so a
slow first step (compilation) never counts and an evaluation between epochs must take 50 steps'
time before it looks like a hang. ``--hang-timeout`` sets it explicitly.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from collections.abc import Sequence

from jaxdist.launch.memstate import read_heartbeat
from jaxdist.launch.reaper import stat_fields

DEFAULT_FLOOR_S = 60.0
DEFAULT_CAP_S = 300.0
DEFAULT_MULTIPLE = 50.0
_WINDOW = 200  # step intervals the median is taken over


@dataclasses.dataclass
class Hung:
    """One rank declared hung: what the log line names.

    Attributes:
      rank: the process id in the job.
      pid: its operating-system pid.
      last_step: its last completed step (None: none this attempt).
      silent_s: seconds since it last reported a step.
      state: its process state from ``/proc`` ("stopped", "running", "sleeping", ...).
    """

    rank: int
    pid: int
    last_step: int | None
    silent_s: float
    state: str

    def describe(self, host: str, timeout_s: float) -> str:
        """The log line naming this rank: host, rank, pid, silence, last step, process state."""
        return (f"rank {self.rank} (host {host}, pid {self.pid}) is hung: no completed step for "
                f"{self.silent_s:.1f} s (hang timeout {timeout_s:g} s), last completed step "
                f"{self.last_step}, process {self.state}")


_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped",
           "t": "stopped by a tracer", "Z": "zombie"}


def process_state(pid: int) -> str:
    """The state of ``pid`` in words, from ``/proc/<pid>/stat`` ("unknown" elsewhere).

    >>> import os
    >>> process_state(os.getpid())
    'running'
    """
    fields = stat_fields(pid)
    if not fields:
        return "unknown"
    return _STATES.get(fields[0], fields[0])


class HangDetector:
    """Watches the heartbeats of one attempt's ranks.

    Args:
      directory: the host's state directory.
      ranks: ``{rank: pid}`` of the ranks started on this host.
      timeout_s: the hang timeout; None adapts it to the observed step time.
      clock: a monotonic clock (tests pass their own).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> det = HangDetector(d, {0: 1}, timeout_s=5, clock=lambda: 0.0)
    >>> det.check([0])  # nothing reported yet: not armed
    []
    """

    def __init__(self, directory: str, ranks: dict[int, int], *, timeout_s: float | None = None,
                 clock=time.monotonic):
        self._dir = directory
        self._ranks = dict(ranks)
        self._fixed = timeout_s
        self._clock = clock
        self._last: dict[int, int | None] = dict.fromkeys(ranks)
        self._changed: dict[int, float | None] = dict.fromkeys(ranks)
        self._intervals: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self._armed_at: float | None = None

    @property
    def timeout_s(self) -> float | None:
        """The current hang timeout (None until adaptive mode has seen two steps)."""
        if self._fixed is not None:
            return self._fixed
        if len(self._intervals) < 2:
            return None
        return min(DEFAULT_CAP_S, max(DEFAULT_FLOOR_S, DEFAULT_MULTIPLE * self.median_step_s()))

    def median_step_s(self) -> float | None:
        """The median time between completed steps so far (None before two steps)."""
        return statistics.median(self._intervals) if self._intervals else None

    def last_steps(self) -> dict[int, int | None]:
        """Each rank's last completed step this attempt."""
        return dict(self._last)

    def check(self, running: Sequence[int]) -> list[Hung]:
        """Reads the heartbeats; returns the ``running`` ranks that are hung (empty if none)."""
        now = self._clock()
        for rank in self._ranks:
            step = read_heartbeat(self._dir, rank)
            if step is not None and step != self._last[rank]:
                if self._changed[rank] is not None and self._last[rank] is not None:
                    gap = (now - self._changed[rank]) / max(1, step - self._last[rank])
                    self._intervals.append(gap)
                self._last[rank], self._changed[rank] = step, now
                if self._armed_at is None:
                    self._armed_at = now
        timeout = self.timeout_s
        if self._armed_at is None or timeout is None:
            return []
        hung = []
        for rank in running:
            since = self._changed[rank] if self._changed[rank] is not None else self._armed_at
            if now - since > timeout:
                pid = self._ranks[rank]
                hung.append(Hung(rank, pid, self._last[rank], now - since, process_state(pid)))
        return hung
