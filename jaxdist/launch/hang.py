"""Hang detection: a rank that makes no progress for too long is declared hung.

Ranks report the training steps they dispatch through a heartbeat file in the host's state
directory (``jaxdist.launch.heartbeat``: any loop, any state); the launcher's agent reads them a few
times a second. Once a rank has made progress in an attempt, a rank (alive, not finished) whose
step count has not moved for the hang timeout is hung: a process stopped by SIGSTOP, a dead peer
inside a collective that never returns, a stuck data loader. The launcher then names the rank the
others wait for (the one that dispatched the fewest steps: its peers are blocked inside a
collective it never entered), has every rank print its Python stack (``SIGUSR1``), and treats the
hang as a failure (kills and re-forms).

The default timeout adapts to the job: ``min(300, max(60, 50 x median step time))`` seconds, so a
slow first step (compilation) never counts and an evaluation between epochs must take 50 steps'
time before it looks like a hang. ``--hang-timeout`` sets it explicitly.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import statistics
import time
from collections.abc import Mapping, Sequence

from jaxdist.launch.heartbeat import Beat, read_heartbeat, stack_pid
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
      dispatched: the steps it had dispatched (None: it reported none this attempt).
    """

    rank: int
    pid: int
    last_step: int | None
    silent_s: float
    state: str
    dispatched: int | None = None

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
        self._beats: dict[int, Beat | None] = dict.fromkeys(ranks)
        self._changed: dict[int, float | None] = dict.fromkeys(ranks)
        self._intervals: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self._armed_at: float | None = None
        self.largest_jump = 1  # the most steps seen between two reports (a call of K steps: K)

    @property
    def timeout_s(self) -> float | None:
        """The current hang timeout (None until adaptive mode has seen two steps)."""
        if self._fixed is not None:
            return self._fixed
        if len(self._intervals) < 2:
            return None
        return min(DEFAULT_CAP_S, max(DEFAULT_FLOOR_S, DEFAULT_MULTIPLE * self.median_step_s()))

    def median_step_s(self) -> float | None:
        """The median time between steps so far (None before two steps)."""
        return statistics.median(self._intervals) if self._intervals else None

    def last_steps(self) -> dict[int, int | None]:
        """Each rank's last step this attempt: completed on the devices where known, else
        dispatched."""
        return {r: None if b is None else b.completed if b.completed is not None else b.dispatched
                for r, b in self._beats.items()}

    def progress(self) -> dict[int, Beat | None]:
        """Each rank's last heartbeat this attempt."""
        return dict(self._beats)

    def check(self, running: Sequence[int]) -> list[Hung]:
        """Reads the heartbeats; returns the ``running`` ranks that are hung (empty if none), and
        with them any running rank behind them (fewer steps dispatched: the one they wait for),
        in rank order."""
        now = self._clock()
        for rank in self._ranks:
            beat = read_heartbeat(self._dir, rank)
            last = self._beats[rank]
            if beat is not None and (last is None or beat.dispatched != last.dispatched):
                if self._changed[rank] is not None and last is not None:
                    steps = abs(beat.dispatched - last.dispatched)
                    self._intervals.append((now - self._changed[rank]) / max(1, steps))
                    self.largest_jump = max(self.largest_jump, steps)
                self._changed[rank] = now
                if self._armed_at is None:
                    self._armed_at = now
            if beat is not None:
                self._beats[rank] = beat
        timeout = self.timeout_s
        if self._armed_at is None or timeout is None:
            return []
        def silent_s(rank: int) -> float:
            since = self._changed[rank]
            return now - (since if since is not None else self._armed_at)

        hung = [rank for rank in running if silent_s(rank) > timeout]
        if hung:
            # A rank behind the hung ones is the one they wait for, though its last report may
            # have reached this host up to a beat later than theirs (heartbeats are written on
            # a timer): it is named too.
            def dispatched(rank: int) -> int:
                beat = self._beats[rank]
                return -1 if beat is None else beat.dispatched
            floor = min(dispatched(rank) for rank in hung)
            hung = sorted({*hung, *(rank for rank in running if dispatched(rank) < floor)})
        last_step = self.last_steps()
        return [Hung(rank, self._ranks[rank], last_step[rank], silent_s(rank),
                     process_state(self._ranks[rank]),
                     None if self._beats[rank] is None else self._beats[rank].dispatched)
                for rank in hung]


def waited_for(dispatched: dict[int, int | None]) -> str:
    """Who the others wait for, from each rank's dispatched steps (across every host).

    A rank that dispatched fewer steps than its peers has not entered the collective they are
    blocked in: it is the one to look at (its stack shows where it is).

    >>> print(waited_for({0: 12, 1: 9, 2: 12}))  # doctest: +NORMALIZE_WHITESPACE
    rank 1 is the one the others wait for: it dispatched 9 steps, ranks [0, 2] dispatched 12 (they
    are blocked inside a collective it has not entered)
    >>> print(waited_for({0: 5, 1: 5}))  # doctest: +NORMALIZE_WHITESPACE
    every rank stopped after dispatching 5 steps: none is behind the others (a step itself, or the
    devices, do not finish)
    """
    known = {r: s for r, s in dispatched.items() if s is not None}
    silent = sorted(r for r, s in dispatched.items() if s is None)
    if not known:
        return f"no rank reported a step (ranks {silent} made no progress at all)"
    low = min(known.values())
    behind = sorted(r for r, s in known.items() if s == low) + silent
    ahead = sorted(r for r, s in known.items() if s > low)
    if not ahead:
        return (f"every rank stopped after dispatching {low} steps: none is behind the others (a "
                "step itself, or the devices, do not finish)")
    who = f"rank {behind[0]} is" if len(behind) == 1 else f"ranks {behind} are"
    it = "it" if len(behind) == 1 else "they"
    high = max(known[r] for r in ahead)
    return (f"{who} the one{'' if len(behind) == 1 else 's'} the others wait for: {it} "
            f"dispatched {low} steps, ranks {ahead} dispatched {high} (they are blocked inside a "
            f"collective {it} {'has' if len(behind) == 1 else 'have'} not entered)")


def stack_ranks(directory: str, ranks: Mapping[int, int]) -> dict[int, int]:
    """Those of ``ranks`` (``{rank: pid}``) that print their Python stacks on ``SIGUSR1`` (see
    ``jaxdist.launch.heartbeat``): to any other process the signal would be fatal."""
    return {rank: pid for rank, pid in sorted(ranks.items()) if stack_pid(directory, rank) == pid}


def request_stacks(ranks: Mapping[int, int]) -> None:
    """Sends ``SIGUSR1`` to each of ``ranks`` (``{rank: pid}``, from ``stack_ranks``). Their
    stacks reach their stderr at once: whatever introduces them must be said before this is
    called."""
    for pid in ranks.values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            pass  # gone already
