"""The in-memory tier's cadence: what copies cost the steps, measured through the run; bounds in
whole calls under ``steps_per_execution``; one slow copy does not set the pace for the job."""

from __future__ import annotations

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
