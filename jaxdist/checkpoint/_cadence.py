"""How often the in-memory tier copies and writes, from what it measures (``jaxdist.memstate``).

:class:`_Cadence` gathers the measurements (the loop's calls, each copy's dispatch, the writer's
writes, when copies land); what follows from them is a pure function, :func:`_choose`.

Beside accelerators, what a copy costs the steps is measured from the loop's calls, which do
not come evenly: while the loop runs ahead of the devices it waits only now and then (``fit``
reads metrics back every third call: more than 4 pending, it reads the 3 oldest), so its calls
come short, short, long. Per call, the rhythm's long call reads as the cost of a copy just
before it, and a copy's dispatch on the loop's thread is made up for by the next wait (it costs
the steps only where the loop, not the devices, sets the pace). So the cost is measured over
whole periods of the rhythm (:func:`_period`): the time of the calls just after each copy against
the pace of whole periods that no copy reaches (:func:`_lost_per_copy`), which includes the
dispatch exactly where it slows the steps. Until the rhythm is known every call is copied (all
calls alike show it); then, until five copies are measured, copies are spaced so that they can
be. A copy's landing is timed by the writer where it waits for it (from the device snapshot to
the host copy), else estimated from the write speed.
"""

from __future__ import annotations

import collections
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

_PACED = 65  # the loop's calls over which what copies cost the steps is measured
_AFTER = 3  # calls after a copy in which the steps may wait for it (the loop's lead over the devices)
_TRUSTED = 5  # copies timed before one alone may space the copies more than a second of steps
_MAX_PERIOD = 12  # the longest rhythm of the loop's calls looked for
_NOISE_S = 1e-6  # what a copy is measured to cost below this is the clock's noise: nothing
_STEADY = 0.15  # calls a period apart differ by at most this share of a step (nine in ten)
_FRESH = 8  # new calls before the calls are looked at again (a decision runs on the loop's thread)
_MEASURED = 5  # copies measured before what a copy costs is trusted
_KEPT = 16  # copies measured that what a copy costs is the median of


def _calls_of(steps: int, per_call: int) -> int:
    """``steps`` rounded up to whole calls of ``per_call`` steps."""
    return -(-steps // per_call) * per_call


def _gap(gaps: collections.deque, last: int | None, step: int | None) -> int | None:
    """Records the steps since ``last`` in ``gaps``; returns the new last step (``step`` None:
    a forced copy or write, no gap of the cadence's)."""
    if step is None:
        return last
    if last is not None and step > last:
        gaps.append(step - last)
    return step


def _period(paces: Sequence[float | None], free: Sequence[bool]) -> int | None:
    """The loop's rhythm: the fewest calls ``P`` such that calls a whole number of ``P`` apart
    take the same time (1: no rhythm); None when that cannot be told.

    It is looked for only among calls that are alike as far as copies go: all of them when no
    copy is in reach of any (``free``) or one is of every one (copies every call), else the
    stretches free of copies that are long enough to hold every period looked for twice. Free
    calls between copies a multiple of the rhythm apart fall at the same phases of it every
    time: they would show no rhythm where there is one. Calls a multiple of the period apart
    are at the same phase; any other distance sets short calls against long ones now and then,
    which a high quantile of the differences sees. Of the periods nearly as steady as the
    steadiest, the shortest (a multiple of the true one is as good, only longer). None when
    not every period could be tried (too few such calls), or neither a rhythm nor its absence
    stands out of the noise.

    >>> _period([0.001, 0.001, 0.121] * 10, [True] * 30)
    3
    >>> _period([0.04] * 30, [True] * 30)
    1
    >>> _period([0.04] * 30, [i % 4 == 3 for i in range(30)]) is None  # between copies: no telling
    True
    """
    x = np.array([np.nan if p is None else p for p in paces], dtype=float)
    free_ = np.asarray(free, dtype=bool)
    ok = ~np.isnan(x)
    if free_.any() and not free_.all():
        # Free stretches of at least 2 * _MAX_PERIOD + 1 calls only
        edges = np.flatnonzero(np.diff(np.concatenate([[0], free_.astype(np.int8), [0]])))
        long = np.zeros_like(free_)
        for start, end in zip(edges[::2], edges[1::2]):
            if end - start > 2 * _MAX_PERIOD:
                long[start:end] = True
        ok &= long
    if ok.sum() < 4:
        return None
    pace = float(np.mean(x[ok]))
    lags = {d: np.abs(x[d:] - x[:-d])[ok[d:] & ok[:-d]]
            for d in range(1, min(2 * _MAX_PERIOD, len(x) - 1) + 1)}
    score = {}
    for p in range(1, _MAX_PERIOD + 1):
        found = np.concatenate([lags[d] for d in range(p, len(lags) + 1, p)] or [np.empty(0)])
        if found.size >= 12:
            nine = int(0.9 * (found.size - 1))  # nine in ten differ by no more
            score[p] = float(np.partition(found, nine)[nine]) / pace
    if len(score) < _MAX_PERIOD:  # some periods could not be tried: no telling
        return None
    best = min(score.values())
    shortest = min(p for p, v in score.items() if v <= max(2 * best, _STEADY / 3))
    if best <= _STEADY:
        return shortest
    if best <= score[1] / 3:  # a noisy loop, with a rhythm that stands out of the noise
        return shortest
    return 1 if score[1] <= 1.5 * best else None  # noise, and no rhythm in it; or no telling


class _Rhythm(NamedTuple):
    """What the loop's last calls say: its ``period`` (calls; None: not known yet), the ``span``
    of calls after a copy in which the steps may show it (whole periods), and what the copies
    whose calls are all known cost the steps: ``(step of the copy, seconds)``, oldest first
    (copies that shared their calls: the first one's step, the cost per copy), against a pace
    known to within ``base_se`` seconds a step (its standard error: shared by those costs)."""

    period: int | None
    span: int
    costs: tuple[tuple[int, float], ...]
    base_se: float = 0.0


def _lost_per_copy(rows: Sequence[tuple[float, int, bool]],
                   period: int | None = None) -> _Rhythm:
    """What copies cost the steps, from the loop's last calls (``(time, step, a copy was taken
    after it)``, oldest first), and the loop's rhythm (``period``: the one known so far, kept
    when these calls cannot tell; while none is known, nothing is measured).

    The loop's pace follows the devices once it runs ahead of them: a step that waits for a
    copy (or a copy's dispatch the loop cannot make up) shows a few calls later (its lead). The
    time of the calls just after each copy (``span``: the lead and a period, in whole periods,
    so that each phase of the rhythm is counted once) is set against the pace of whole periods
    that no copy reaches. Copies closer than ``span`` share their calls: those count together,
    per copy. No cost while fewer than 16 calls are known or fewer than 4 whole periods are
    free of copies.

    >>> t, rows = 0.0, []
    >>> for call in range(60):  # calls of 1, 1 and 121 ms; a copy at every 12th costs 5 ms
    ...     rows.append((t, call, call % 12 == 0))
    ...     t += (0.001, 0.001, 0.121)[call % 3] + (0.005 if call % 12 == 1 else 0.0)
    >>> _lost_per_copy(rows).costs  # no rhythm known, and copies too close to tell one
    ()
    >>> r = _lost_per_copy(rows, period=3)  # as it was told by calls all copied, or none
    >>> r.period, r.span, [(step, round(cost, 4)) for step, cost in r.costs]
    (3, 6, [(12, 0.005), (24, 0.005), (36, 0.005), (48, 0.005)])
    """
    rows = list(rows)[2:]  # the first calls compile
    paces = [(t1 - t0, s1 - s0) if s1 > s0 else None
             for (t0, s0, _), (t1, s1, _) in zip(rows, rows[1:])]  # paces[i]: rows i..i+1
    copied = [r[2] for r in rows]
    known = period or 1
    reach = _calls_of(_AFTER + known - 1, known)  # of a copy, as far as the rhythm known says
    near = [any(copied[max(0, i + 1 - reach):i + 1]) for i in range(len(paces))]
    period = _period([None if p is None else p[0] / p[1] for p in paces],
                     [not n for n in near]) or period
    span = _calls_of(_AFTER + (period or 1) - 1, period or 1)
    if len(rows) < 16 or period is None:
        return _Rhythm(period, span, ())
    # A call is free when no copy is within ``span`` before it (the first calls: not known)
    free = [i >= span - 1 and not any(copied[i + 1 - span:i + 1]) for i in range(len(paces))]
    whole, i = [], 0  # seconds per step over whole periods free of copies, none overlapping
    while i + period <= len(paces):
        window = paces[i:i + period]
        if all(free[i:i + period]) and None not in window:
            whole.append(sum(p[0] for p in window) / sum(p[1] for p in window))
            i += period
        else:
            i += 1
    if len(whole) < 4:
        return _Rhythm(period, span, ())
    base = statistics.median(whole)
    base_se = _median_se(whole, len(whole))
    costs = []
    i = 0
    while i < len(rows):
        if not copied[i]:
            i += 1
            continue
        start, end, count = i, i + span, 1
        i += 1
        while i < end and i < len(rows):  # copies within reach of the last share its calls
            if copied[i]:
                count, end = count + 1, i + span
            i += 1
        if start >= span - 1 and end <= len(paces):  # nothing before it unknown, all after known
            costs.append((rows[start][1], sum(p[0] - base * p[1] for p in paces[start:end]
                                              if p is not None) / count))
    return _Rhythm(period, span, tuple(costs), base_se)


def _median_se(values: Sequence[float], n: int) -> float:
    """The standard error of the median of ``values`` (``n`` of them independent), from their
    median absolute deviation (one outlier moves it not)."""
    middle = statistics.median(values)
    return 1.2533 * 1.4826 * statistics.median(abs(v - middle) for v in values) / math.sqrt(n)


class TierMeasurements(NamedTuple):
    """What :func:`_choose` decides from (seconds unless said)."""

    step_s: float  # a step, as the loop or the devices are timed
    loop_s: float  # a copy's dispatch on the loop's thread (median)
    copy_s: float  # a copy, estimated from the bytes and the writer's speed
    land_s: float | None  # a copy's landing after its step, measured (None: not measured)
    lost_s: float | None  # what a copy cost the steps, last measured (None: never)
    persist_cpu_s: float  # a write's CPU time
    persist_s: float  # a write's wall time
    # Calls between copies while what a copy costs is measured: every call (1) until the loop's
    # rhythm is known, then far enough apart for whole free periods between them; 0: no calls
    # seen, nothing to measure.
    probe: int
    copies_timed: int
    call_steps: int  # steps per call of the loop
    copy_gaps: tuple[int, ...]  # steps between the copies and between the writes, as they came
    write_gaps: tuple[int, ...]
    # The slowest recent write and landing (None: as persist_s and land_s): the bounds promise
    # what a failure may cost, so they count the slow ones a loaded host has, not the median
    persist_worst_s: float | None = None
    land_worst_s: float | None = None


class TierChoice(NamedTuple):
    """Steps between copies and between writes; the most steps a failure may cost when other
    processes survive it (``bound``) and when none does (``bound_all``)."""

    copy_every: int
    k: int
    bound: int
    bound_all: int


def _charges(parts: dict[str, float], host_is_device: bool) -> tuple[float, float]:
    """What one copy and one write take from training (seconds), from ``parts``."""
    if not host_is_device:
        # The copy and the write run beside the devices: a copy costs what the steps lose to
        # it, as measured (its dispatch included where the loop could not make that up); until
        # measured, its dispatch.
        return parts.get("lost_s", parts["loop_s"]), 0.0
    # On XLA:CPU a copy's launch also costs the devices (the same cores) about what its
    # dispatch costs the loop: counted twice. It is what tiny steps pay most for.
    return 2 * parts["loop_s"] + parts["copy_s"], parts["persist_cpu_s"]


def _parts(m: TierMeasurements) -> dict[str, float]:
    parts = {"loop_s": m.loop_s, "copy_s": m.copy_s, "persist_cpu_s": m.persist_cpu_s,
             "persist_s": m.persist_s}
    if m.land_s is not None:
        parts["land_s"] = m.land_s
    if m.lost_s is not None:
        parts["lost_s"] = m.lost_s
    return parts


def _choose(m: TierMeasurements, *, every: int | None, budget: float, host_is_device: bool) -> TierChoice:
    """How often to copy and to write, and what a failure may cost then (steps).

    Copies as often as ``budget`` (a share of steps/s) allows, the writes within what is left
    (never more often than one write takes); ``every`` fixes both. Beside accelerators, until
    what a copy costs is measured, copies come as ``m.probe`` says. A failure loses the steps
    since the newest copy that had landed: at most the longest recent gap between copies plus
    the steps a copy takes to land, less one; copies come only at a call's end, so a gap is a
    whole number of calls.

    >>> m = TierMeasurements(step_s=0.041, loop_s=0.008, copy_s=0.06, land_s=0.028, lost_s=0.001,
    ...               persist_cpu_s=0.3, persist_s=0.115, probe=12, copies_timed=9, call_steps=1,
    ...               copy_gaps=(1, 1), write_gaps=(3, 3))
    >>> _choose(m, every=None, budget=0.05, host_is_device=False)
    TierChoice(copy_every=1, k=3, bound=1, bound_all=5)
    """
    step = m.step_s
    copy_cost, persist_cost = _charges(_parts(m), host_is_device)
    writes = max(1, math.ceil(max(m.persist_s, m.persist_worst_s or 0) / step))
    land = m.copy_s if m.land_s is None else max(m.land_s, m.land_worst_s or 0)
    lands = max(1, math.ceil(land / step))  # steps a copy takes to be ready after its step
    if every is not None:
        copy_every = k = every
    else:
        share = budget if persist_cost == 0 else budget * 2 / 3
        copy_every = max(1, math.ceil(copy_cost / (share * step)))
        if m.copies_timed < _TRUSTED:  # too few copies timed for one to set the pace
            copy_every = min(copy_every, max(8, math.ceil(1.0 / step)))
        if not host_is_device and m.lost_s is None and m.probe:
            # What a copy costs is not known yet (its dispatch may cost the steps nothing, or
            # the steps may wait for it): copies far enough apart for it to be measured, once
            # the loop's rhythm is known (until then, every call: all calls alike show it).
            copy_every = 1 if m.probe == 1 else max(copy_every, m.probe * m.call_steps)
        left = budget - copy_cost / (copy_every * step)
        by_budget = math.ceil(persist_cost / (left * step)) if persist_cost else 1
        k = min(10_000, max(copy_every, by_budget, writes))
    per = m.call_steps
    bound = max([_calls_of(copy_every, per), *m.copy_gaps]) + lands - 1
    bound_all = max([_calls_of(k, per), *m.write_gaps]) + writes - 1
    return TierChoice(copy_every, k, bound, bound_all)


class _Cadence:
    """How often to copy and how often to persist, from measured costs (see the module's
    docstring).

    A host copy costs, beside accelerators, what the steps lose to it, measured over the loop's
    calls (:func:`_lost_per_copy`; its dispatch, measured in :meth:`InMemoryTier.save`, until then);
    where the devices are the host's own cores (XLA:CPU), its dispatch, its launch on the devices
    (about the dispatch again) and the memory copy itself (estimated from the bytes and the copy
    speed the writer measures). A persist costs, on XLA:CPU, the writer thread's CPU time
    (``time.thread_time``: steady however busy the machine is); elsewhere it runs beside the
    devices. The first persist (first-use setup) is not counted.
    """

    def __init__(self, every: int | None, budget: float, host_is_device: bool, nbytes: int,
                 decide: Callable[..., TierChoice] | None = None):
        self.every, self.budget, self.host_is_device = every, budget, host_is_device
        # The decision, a pure function of what is measured here: the policy's
        # (MemoryTierPolicy.decide), or the same rule over ``every`` and ``budget``.
        self._choice_of = decide or functools.partial(_choose, every=every, budget=budget)
        self.nbytes = nbytes
        self._steps: collections.deque = collections.deque(maxlen=64)  # seconds per step
        # (time, step) of the loop's calls: its pace once it waits on the devices (a bound on
        # the steps in flight), until copies that had to be waited for time the steps.
        self._calls: collections.deque = collections.deque(maxlen=33)
        # (time, step, a copy was taken) of the loop's last calls: what the steps lose to
        # copies, re-measured through the run (_lost_per_copy)
        self._paced: collections.deque = collections.deque(maxlen=_PACED)
        self._rhythm = _Rhythm(None, _AFTER, ())  # what the calls said, last looked at
        self._offered = self._looked = 0  # calls offered; calls offered when last looked at
        self._costs: dict[int, float] = {}  # what the last copies measured cost, by their step
        self._lost: float | None = None  # what a copy costs the steps, as measured so far
        self._call_sizes: collections.deque = collections.deque(maxlen=8)  # steps per call
        self._last_done: tuple[float, int] | None = None
        self._loops: collections.deque = collections.deque(maxlen=9)
        self._lands: collections.deque = collections.deque(maxlen=9)  # a copy's landing, s
        self._persists: collections.deque = collections.deque(maxlen=5)  # (cpu s, wall s)
        # Steps between the copies taken and between the writes: more than asked for when a copy
        # had no room (the loop runs steps ahead of the devices, so the copy before it may not
        # have landed yet). The bounds use what happened, not what was asked for.
        self._copy_gaps: collections.deque = collections.deque(maxlen=8)
        self._write_gaps: collections.deque = collections.deque(maxlen=4)
        self._copied: int | None = None
        self._written: int | None = None
        self._seen = 0
        self.copy_every = self.k = every or 1
        self.bound: int | None = None  # steps a failure may cost (None until decided)
        self.bound_all: int | None = None
        self.parts: dict[str, float] = {}

    def on_done(self, step: int) -> None:
        """The copy of ``step`` is done, so the step is: steps are timed as the devices finish
        them (the loop's own calls come in bursts while it runs ahead of the devices)."""
        now = time.perf_counter()
        if self._last_done is not None and step > self._last_done[1]:
            self._steps.append((now - self._last_done[0]) / (step - self._last_done[1]))
        self._last_done = (now, step)

    def on_landed(self, seconds: float) -> None:
        """A copy landed in host memory ``seconds`` after its step was done on the devices (as
        the writer saw it: it waited for both): what a failure may lose beyond the copies' gap."""
        self._lands.append(seconds)

    def on_call(self, step: int) -> None:
        """The loop offers ``step`` (every call: each step, or each ``steps_per_execution``
        call's last; a copy is taken or not)."""
        now = time.perf_counter()
        self._offered += 1
        if self._calls and step > self._calls[-1][1]:
            self._call_sizes.append(step - self._calls[-1][1])
        self._calls.append((now, step))
        self._paced.append((now, step, False))

    def call_steps(self) -> int:
        """Steps per call of the loop (``fit``'s ``steps_per_execution``): copies come only at
        the end of a call, so a gap between copies is a whole number of calls."""
        return max(self._call_sizes, default=1)

    def step_s(self) -> float | None:
        """The median time per step as the devices finish them (the first two intervals left
        out: compilation), else, while no copy has been waited for (the writer is behind, or
        every copy had landed), the loop's pace over its last 32 calls in whole periods of its
        rhythm (the first two left out; 8 steps at least), else None."""
        values = list(self._steps)[2:] if len(self._steps) > 4 else []
        if values:
            return statistics.median(values)
        calls = list(self._calls)[2:]
        calls = calls[(len(calls) - 1) % (self._rhythm.period or 1):]  # the newest whole periods
        if len(calls) < 3 or calls[-1][1] - calls[0][1] < 8:
            return None
        return (calls[-1][0] - calls[0][0]) / (calls[-1][1] - calls[0][1])

    def on_copy(self, loop_s: float, step: int | None = None) -> None:
        self._loops.append(loop_s)
        if self._paced:
            self._paced[-1] = (*self._paced[-1][:2], True)
        self._copied = _gap(self._copy_gaps, self._copied, step)
        if self.parts:  # re-decided at every copy: what a copy costs is measured as the job runs
            self._decide()

    def on_persist(self, cpu_s: float, wall_s: float, step: int | None = None) -> None:
        self._written = _gap(self._write_gaps, self._written, step)
        self._seen += 1
        if self._seen > 1:  # the first: creating files, first use of every code path
            self._persists.append((cpu_s, wall_s))
            self._decide()

    def _decide(self) -> None:
        if self._paced and (self._offered - self._looked >= _FRESH or not self._looked):
            self._look()
        step = self.step_s()
        if step is None or step <= 0 or not self._persists or not self._loops:
            return
        wall = statistics.median(p[1] for p in self._persists)
        m = TierMeasurements(
            step_s=step, loop_s=statistics.median(self._loops),
            # The writer reads and writes the bytes once and sums them: a copy moves them once.
            copy_s=self.nbytes / max(self.nbytes / max(wall, 1e-6) * 2, 1e9),
            land_s=statistics.median(self._lands) if self._lands else None, lost_s=self._lost,
            persist_cpu_s=statistics.median(p[0] for p in self._persists), persist_s=wall,
            probe=(0 if not self._paced else 1 if self._rhythm.period is None
                   else self._rhythm.span + 2 * self._rhythm.period),
            copies_timed=len(self._loops), call_steps=self.call_steps(),
            copy_gaps=tuple(self._copy_gaps), write_gaps=tuple(self._write_gaps),
            persist_worst_s=max(p[1] for p in self._persists),
            land_worst_s=max(self._lands) if self._lands else None)
        self.parts = _parts(m)
        choice = self._choice_of(m, host_is_device=self.host_is_device)
        self.copy_every, self.k, self.bound, self.bound_all = choice

    def _look(self) -> None:
        """Looks at the loop's last calls again: its rhythm, what the copies among them cost.
        Copies measured add up across looks (a copy is measured again while its calls are in
        view); what a copy costs follows from the last 16 once there are 5, and stands while
        copies come too close together to be measured."""
        self._looked = self._offered
        period = self._rhythm.period
        if period is None and self._offered >= _PACED:
            period = 1  # no rhythm has shown in a window of calls: taken as none (as before)
        self._rhythm = _lost_per_copy(self._paced, period)
        if not self._rhythm.costs:
            return  # nothing measured in these calls: what was stands
        self._costs.update(self._rhythm.costs)
        for step in sorted(self._costs)[:-_KEPT]:
            self._costs.pop(step, None)  # the loop's thread and the writer's both decide
        if len(self._costs) >= _MEASURED:
            # The median, and two standard errors on top (its own, and the pace's it was
            # measured against, which its copies share): a noisy loop's few copies measured
            # err towards copying less often, not past the budget. Exact where steps are even.
            costs = list(self._costs.values())
            se = math.hypot(_median_se(costs, len(costs)), self._rhythm.span * self._rhythm.base_se)
            lost = statistics.median(costs) + 2 * se
            self._lost = lost if lost > _NOISE_S else 0.0

    def cost(self) -> float | None:
        """The tier's time per step taken from training (seconds), as measured."""
        if not self.parts or self.step_s() is None:
            return None
        copy, persist = _charges(self.parts, self.host_is_device)
        return copy / self.copy_every + persist / self.k


_Measured = TierMeasurements  # the names before 0.4.0's (private)
_Choice = TierChoice
