"""How often the in-memory tier copies and writes, from what it measures (``jaxdist.memstate``)."""

from __future__ import annotations

import collections
import math
import statistics
import time


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
        """The loop offers ``step`` (every step; a copy is taken or not)."""
        self._calls.append((time.perf_counter(), step))

    def step_s(self) -> float | None:
        """The median time per step as the devices finish them (the first two intervals left
        out: compilation), else, while no copy has been waited for (the writer is behind, or
        every copy had landed), the loop's pace over its last 32 steps (the first two calls
        left out), else None."""
        values = list(self._steps)[2:] if len(self._steps) > 4 else []
        if values:
            return statistics.median(values)
        calls = list(self._calls)[2:] if len(self._calls) > 10 else []
        if calls and calls[-1][1] > calls[0][1]:
            return (calls[-1][0] - calls[0][0]) / (calls[-1][1] - calls[0][1])
        return None

    def on_copy(self, loop_s: float, step: int | None = None) -> None:
        self._loops.append(loop_s)
        self._copied = _gap(self._copy_gaps, self._copied, step)

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
        copy_cost, persist_cost = self._charges()
        writes = max(1, math.ceil(wall / step))
        lands = max(1, math.ceil(copy / step))  # steps a copy takes to be ready after its step
        if self.every is not None:
            self.copy_every = self.k = self.every
        else:
            share = self.budget if persist_cost == 0 else self.budget * 2 / 3
            self.copy_every = max(1, math.ceil(copy_cost / (share * step)))
            left = self.budget - copy_cost / (self.copy_every * step)
            by_budget = math.ceil(persist_cost / (left * step)) if persist_cost else 1
            self.k = min(10_000, max(self.copy_every, by_budget, writes))
        # A failure loses the steps since the newest copy that had landed: at most the longest
        # recent gap between copies plus the steps a copy takes to land, less one.
        self.bound = max([self.copy_every, *self._copy_gaps]) + lands - 1
        self.bound_all = max([self.k, *self._write_gaps]) + writes - 1

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
            return p["loop_s"], 0.0  # the copy and the write run beside the devices
        # On XLA:CPU a copy's launch also costs the devices (the same cores) about what its
        # dispatch costs the loop: counted twice. It is what tiny steps pay most for.
        return 2 * p["loop_s"] + p["copy_s"], p["persist_cpu_s"]
