"""How often the in-memory tier copies and writes, from what it measures (``jaxdist.memstate``)."""

from __future__ import annotations

import collections
import math
import statistics
import time

_PACED = 65  # the loop's calls over which what copies cost the steps is measured
_AFTER = 3  # calls after a copy in which the steps may wait for it (the loop's lead over the devices)
_TRUSTED = 5  # copies timed before one alone may space the copies more than a second of steps


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


class _Cadence:
    """How often to copy and how often to persist, from measured costs (see the module's
    docstring).

    A host copy costs the loop its dispatch (measured in :meth:`StateTier.save`) and, where the
    devices are the host's own cores (XLA:CPU), its launch on the devices (about the dispatch
    again) and the memory copy itself (estimated from the bytes and the copy speed the writer
    measures). A persist costs, on XLA:CPU, the writer thread's CPU
    time (``time.thread_time``: steady however busy the machine is); elsewhere it runs beside the
    devices. The first persist (first-use setup) is not counted.
    """

    def __init__(self, every: int | None, budget: float, host_is_device: bool, nbytes: int):
        self.every, self.budget, self.host_is_device = every, budget, host_is_device
        self.nbytes = nbytes
        self._steps: collections.deque = collections.deque(maxlen=64)  # seconds per step
        # (time, step) of the loop's calls: its pace once it waits on the devices (a bound on
        # the steps in flight), until copies that had to be waited for time the steps.
        self._calls: collections.deque = collections.deque(maxlen=33)
        # (time, step, a copy was taken) of the loop's last calls: what the steps lose to
        # copies, re-measured through the run (_lost_per_copy)
        self._paced: collections.deque = collections.deque(maxlen=_PACED)
        self._lost: float | None = None  # what a copy cost the steps, last measured
        self._call_sizes: collections.deque = collections.deque(maxlen=8)  # steps per call
        self._last_done: tuple[float, int] | None = None
        self._loops: collections.deque = collections.deque(maxlen=9)
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
        self.bound = self.bound_all = None
        self.parts: dict[str, float] = {}

    def on_done(self, step: int) -> None:
        """The copy of ``step`` is done, so the step is: steps are timed as the devices finish
        them (the loop's own calls come in bursts while it runs ahead of the devices)."""
        now = time.perf_counter()
        if self._last_done is not None and step > self._last_done[1]:
            self._steps.append((now - self._last_done[0]) / (step - self._last_done[1]))
        self._last_done = (now, step)

    def on_call(self, step: int) -> None:
        """The loop offers ``step`` (every call: each step, or each ``steps_per_execution``
        call's last; a copy is taken or not)."""
        now = time.perf_counter()
        if self._calls and step > self._calls[-1][1]:
            self._call_sizes.append(step - self._calls[-1][1])
        self._calls.append((now, step))
        self._paced.append((now, step, False))

    def call_steps(self) -> int:
        """Steps per call of the loop (``fit``'s ``steps_per_execution``): copies come only at
        the end of a call, so a gap between copies is a whole number of calls."""
        return max(self._call_sizes, default=1)

    def _lost_per_copy(self) -> float | None:
        """What one copy costs the steps, measured over the loop's last calls (None: not enough
        of them, or no call free of copies): the loop's pace, which follows the devices once it
        runs ahead of them, in the calls just after a copy (a step that waits for the copy is
        seen there, a few calls later than the copy: the loop's lead) against the others;
        medians, so an epoch's end or one slow step moves neither; times the calls a copy
        affects. Re-measured at every copy, over a rolling window."""
        rows = list(self._paced)[2:]  # the first calls compile
        if len(rows) < 16:
            return None
        paces = [((t1 - t0) / (s1 - s0), s1 - s0) if s1 > s0 else None
                 for (t0, s0, _), (t1, s1, _) in zip(rows, rows[1:])]  # paces[i]: rows i..i+1
        near = [any(r[2] for r in rows[max(0, i + 1 - _AFTER):i + 1]) for i in range(len(paces))]
        free = [p[0] for p, n in zip(paces, near) if p is not None and not n]
        copies = [i for i, r in enumerate(rows[:-_AFTER]) if r[2]]
        if len(free) < 4 or not copies:
            return None
        base = statistics.median(free)
        # Each copy's excess over the calls after it (median over copies: one outlier, an
        # epoch's end, moves nothing); calls after two copies are shared between them.
        excess = [sum(max(0.0, p[0] - base) * p[1] for p in paces[i:i + _AFTER] if p is not None)
                  for i in copies]
        return statistics.median(excess)

    def step_s(self) -> float | None:
        """The median time per step as the devices finish them (the first two intervals left
        out: compilation), else, while no copy has been waited for (the writer is behind, or
        every copy had landed), the loop's pace over its last 32 calls (the first two left
        out; 8 steps at least), else None."""
        values = list(self._steps)[2:] if len(self._steps) > 4 else []
        if values:
            return statistics.median(values)
        # 8 steps at least past the first two calls (under steps_per_execution, fewer calls)
        calls = list(self._calls)[2:]
        if len(calls) < 3 or calls[-1][1] - calls[0][1] < 8:
            calls = []
        if calls and calls[-1][1] > calls[0][1]:
            return (calls[-1][0] - calls[0][0]) / (calls[-1][1] - calls[0][1])
        return None

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
        step = self.step_s()
        if step is None or step <= 0 or not self._persists or not self._loops:
            return
        loop = statistics.median(self._loops)
        cpu = statistics.median(p[0] for p in self._persists)
        wall = statistics.median(p[1] for p in self._persists)
        # The writer reads and writes the bytes once and sums them: a copy moves them once.
        copy = self.nbytes / max(self.nbytes / max(wall, 1e-6) * 2, 1e9)
        self.parts = {"loop_s": loop, "copy_s": copy, "persist_cpu_s": cpu, "persist_s": wall}
        lost = self._lost_per_copy()
        if lost is not None:  # else the last measurement stands (copies every call: no free one)
            self._lost = lost
        if self._lost is not None:
            self.parts["lost_s"] = self._lost
        copy_cost, persist_cost = self._charges()
        writes = max(1, math.ceil(wall / step))
        lands = max(1, math.ceil(copy / step))  # steps a copy takes to be ready after its step
        if self.every is not None:
            self.copy_every = self.k = self.every
        else:
            share = self.budget if persist_cost == 0 else self.budget * 2 / 3
            self.copy_every = max(1, math.ceil(copy_cost / (share * step)))
            if len(self._loops) < _TRUSTED:  # too few copies timed for one to set the pace
                self.copy_every = min(self.copy_every, max(8, math.ceil(1.0 / step)))
            left = self.budget - copy_cost / (self.copy_every * step)
            by_budget = math.ceil(persist_cost / (left * step)) if persist_cost else 1
            self.k = min(10_000, max(self.copy_every, by_budget, writes))
        # A failure loses the steps since the newest copy that had landed: at most the longest
        # recent gap between copies plus the steps a copy takes to land, less one. Copies come
        # only at a call's end: a gap is a whole number of calls.
        per = self.call_steps()
        self.bound = max([_calls_of(self.copy_every, per), *self._copy_gaps]) + lands - 1
        self.bound_all = max([_calls_of(self.k, per), *self._write_gaps]) + writes - 1

    def cost(self) -> float | None:
        """The tier's time per step taken from training (seconds), as measured."""
        if not self.parts or self.step_s() is None:
            return None
        copy, persist = self._charges()
        return copy / self.copy_every + persist / self.k

    def _charges(self) -> tuple[float, float]:
        """What one copy and one write take from training (seconds), from :attr:`parts`."""
        p = self.parts
        if not self.host_is_device:
            # The copy and the write run beside the devices: a copy costs its dispatch and what
            # the steps it overlaps lose (a step that waits for it), as measured.
            return max(p["loop_s"], p.get("lost_s", 0.0)), 0.0
        # On XLA:CPU a copy's launch also costs the devices (the same cores) about what its
        # dispatch costs the loop: counted twice. It is what tiny steps pay most for.
        return 2 * p["loop_s"] + p["copy_s"], p["persist_cpu_s"]
