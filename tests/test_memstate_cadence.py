"""The in-memory tier's cadence: what copies cost the steps, measured through the run; bounds in
whole calls under ``steps_per_execution``; one slow copy does not set the pace for the job."""

from __future__ import annotations

import collections
import math

import pytest

from jaxdist.checkpoint import _cadence
from jaxdist.checkpoint._cadence import _Cadence


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(_cadence.time, "perf_counter", lambda: now[0])
    return now


def _run(c, clock, steps, *, step_s, copy_every, copy_slows=0.0, per_call=1, loop_s=0.001,
         start=1):
    """Calls every ``per_call`` steps of ``step_s`` each; a copy every ``copy_every`` steps
    whose flight slows the call after it by ``copy_slows`` seconds."""
    waits = []  # the loop sees a step wait for a copy two calls later (its lead)
    for step in range(start, start + steps, per_call):
        clock[0] += step_s * per_call + (copy_slows if waits and waits.pop(0) else 0.0)
        c.on_call(step)
        if step % copy_every < per_call:
            c.on_copy(loop_s, step)
            waits = [False, True]


def test_what_the_steps_lose_to_a_copy_is_measured_and_spaces_the_copies(clock):
    # before: on an accelerator a copy was charged only its dispatch (1 ms), so copies came
    # every step though each made the step after it wait 20 ms (the step donating what the copy
    # read): 50% of steps/s against a 5% budget
    c = _Cadence(None, 0.05, host_is_device=False, nbytes=10**9)
    _run(c, clock, 80, step_s=0.04, copy_every=4, copy_slows=0.02)
    c.on_persist(cpu_s=0.1, wall_s=0.1)  # the first: not counted
    c.on_persist(cpu_s=0.1, wall_s=0.1)
    assert c.parts["lost_s"] == pytest.approx(0.02)
    assert c.copy_every == math.ceil(0.02 / (0.05 * c.step_s())) == 9  # 5% of 45 ms steps
    assert c.cost() <= 0.05 * c.step_s() + 1e-9
    # copies that cost the steps nothing (a device snapshot): every step again, re-measured
    _run(c, clock, 130, step_s=0.04, copy_every=9, copy_slows=0.0, start=81)
    assert c.parts["lost_s"] == 0.0 and c.copy_every == 1
    # copied every call, no call is free of copies: the last measurement stands
    _run(c, clock, 100, step_s=0.04, copy_every=1, copy_slows=0.0, start=211)
    assert c.parts["lost_s"] == 0.0 and c.copy_every == 1


def test_one_slow_copy_does_not_space_the_copies_for_the_rest_of_the_job(clock):
    # before: the first copy to pinned host memory (1.3 s: the pool grew) was most of what the
    # cadence knew; it copied every 650 steps of 40 ms and never timed a copy again
    c = _Cadence(None, 0.05, host_is_device=False, nbytes=10**9)
    _run(c, clock, 12, step_s=0.04, copy_every=100)  # paced, no copy yet
    c.on_copy(1.3, 12)
    c.on_persist(cpu_s=0.1, wall_s=0.1)
    c.on_copy(0.001, 13)
    c.on_persist(cpu_s=0.1, wall_s=0.1)
    assert c.copy_every <= 25  # at most a second of steps until five copies are timed
    for start in range(14, 214, 20):
        _run(c, clock, 20, step_s=0.04, copy_every=c.copy_every, loop_s=0.001, start=start)
    assert c.copy_every == 1


@pytest.mark.parametrize("per_call", [1, 4])
def test_under_steps_per_execution_the_bounds_count_whole_calls(clock, per_call):
    # before: asked to copy every 5 steps with calls of 4, the tier announced "at most 5" while
    # copies came every 8 steps (only a call's end can be copied)
    c = _Cadence(5, 0.05, host_is_device=True, nbytes=10**6)
    _run(c, clock, 80, step_s=0.01, copy_every=5, per_call=per_call)
    c.on_persist(cpu_s=0.001, wall_s=0.001)
    c.on_persist(cpu_s=0.001, wall_s=0.001)
    assert c.call_steps() == per_call
    assert c.bound >= (8 if per_call == 4 else 5)


def _fit_like(c, clock, steps, *, copy_costs, step_s=0.041, dispatch=(0.003, 0.008, 0.013),
              host_s=0.0005, max_in_flight=4, write_s=0.115, start=1):
    """``fit``'s loop over devices that take ``step_s`` a step, as the tier sees it: the loop
    dispatches a step (``host_s``), pushes its metrics (``_Meter.push``: more than
    ``max_in_flight`` pending, it waits for the oldest to be read back, so its calls come short,
    short, long) and offers the step to the tier, which copies it when due: ``dispatch`` seconds
    of the loop's time, and ``copy_costs`` seconds of the devices' (the on-device snapshot, in
    order between two steps). The writer writes every ``k`` steps. Returns the devices' time per
    step over the last half of the steps (``start``: the first step; the loop starts afresh)."""
    device, done, pending = clock[0], {}, collections.deque()
    copied = written = None
    for step in range(start, start + steps):
        clock[0] += host_s
        device = done[step] = max(device, clock[0]) + step_s
        pending.append(step)
        if len(pending) > max_in_flight:
            read = [pending.popleft() for _ in range(len(pending) - (max_in_flight + 1) // 2)]
            clock[0] = max(clock[0], done[read[-1]])  # reading back waits for the devices
        c.on_call(step)
        if copied is None or step - copied >= c.copy_every:
            loop_s = dispatch[step % len(dispatch)]
            clock[0] += loop_s
            device = max(device, clock[0]) + copy_costs
            c.on_copy(loop_s, step)
            copied = step
            if written is None or step - written >= c.k:
                c.on_persist(cpu_s=0.3, wall_s=write_s, step=step)
                written = step
    last, half = start + steps - 1, start + steps // 2
    return (done[last] - done[half]) / (last - half)


def test_fits_read_rhythm_is_not_taken_for_what_a_copy_costs(clock):
    # before: fit's calls come short, short, long (it reads metrics back every third call); the
    # cadence took the median call (a short one) as the steps' pace and the three calls after
    # each copy (one of them long) as its cost: every copy seemed to cost ~3 steps (120 ms), so
    # a copy that costs the devices 1 ms came every ~58 steps and a failure could cost 60
    c = _Cadence(None, 0.05, host_is_device=False, nbytes=1_300_000_000)
    per_step = _fit_like(c, clock, 400, copy_costs=0.001)
    assert c.parts["lost_s"] == pytest.approx(0.001, abs=3e-4)
    assert c.copy_every <= 2
    assert c.bound <= 4
    assert 1 - 0.041 / per_step <= 0.05  # what the copies really cost: within the budget


def test_a_copy_that_costs_the_steps_much_is_still_spaced_within_the_budget(clock):
    # the fit above is no licence to copy every step: a copy that costs the devices 20 ms of a
    # 41 ms step, in the same rhythm, is measured so and spaced within the 5% budget
    c = _Cadence(None, 0.05, host_is_device=False, nbytes=1_300_000_000)
    per_step = _fit_like(c, clock, 400, copy_costs=0.02)
    assert c.parts["lost_s"] == pytest.approx(0.02, rel=0.1)
    assert c.copy_every >= 9  # 20 ms against 5% of ~43 ms steps
    assert 1 - 0.041 / per_step <= 0.05  # what the copies really cost: within the budget
    assert c.cost() <= 0.05 * c.step_s() + 1e-9


def test_a_copys_landing_is_measured_where_the_writer_saw_it_not_estimated(clock):
    # before: a copy was taken to land after nbytes / (twice the write speed, >= 1 GB/s): 1.3 GB
    # written in 0.115 s "landed" in 58 ms, 2 steps of 41 ms, where it lands in 26-30 ms
    c = _Cadence(None, 0.05, host_is_device=False, nbytes=1_300_000_000)
    _fit_like(c, clock, 200, copy_costs=0.001)
    assert "land_s" not in c.parts and c.bound == c.copy_every + 1  # estimated: 2 steps
    for _ in range(3):
        c.on_landed(0.028)  # the writer waited for the snapshot, then for the host copy
    _fit_like(c, clock, 40, copy_costs=0.001, start=201)
    assert c.parts["land_s"] == pytest.approx(0.028)
    assert c.bound == c.copy_every  # lands within the step after it
    for _ in range(6):
        c.on_landed(0.2)  # a slow copy engine: about 5 steps
    _fit_like(c, clock, 40, copy_costs=0.001, start=241)
    assert c.bound == c.copy_every + math.ceil(0.2 / c.step_s()) - 1
