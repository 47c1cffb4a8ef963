"""Bounded run-ahead in every loop: the README's plain Python loops, long, on 8 simulated devices."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.conftest import REPO, run_python

SCRIPT = os.path.join(REPO, "tests", "_scripts", "readme_loops.py")


@pytest.mark.slow
@pytest.mark.parametrize("view", ["global", "per_replica"])
def test_readme_loop_of_450_steps_on_8_devices_completes(view, tmp_path):
    out = tmp_path / "params.npz"
    # digits: 1437 examples / batch 16 = 90 steps an epoch; 5 epochs = 450 steps, several times what
    # XLA:CPU's rendezvous survives when nothing bounds the steps in flight.
    proc = run_python([SCRIPT, view, "5", "16", str(out)], timeout=300, devices=8)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    saved = np.load(out)
    assert int(saved["steps"]) == 450 and int(saved["devices"]) == 8
    assert all(np.isfinite(saved[k]).all() for k in saved.files if k.startswith("arr_"))


def test_in_flight_bound_is_validated():
    import jax

    import jaxdist

    s = jaxdist.MirroredStrategy(jax.devices()[:1])
    for bad in (0, 33, 2.5, True):
        with pytest.raises(ValueError, match=r"max_in_flight=.* must be an int in \[1, 32\]"):
            s.step(lambda st, b: (st, {}), max_in_flight=bad)


@pytest.mark.parametrize("max_in_flight", [1, 2, 3, 8, 32])
def test_in_flight_never_leaves_more_than_the_bound_queued_and_waits_once_per_half_window(
        max_in_flight):
    from jaxdist.core.step import InFlight

    class Step:  # stands for one dispatched step's output; "done" once waited for
        def __init__(self, k):
            self.k, self.done = k, False

        def is_deleted(self):
            return False

        def block_until_ready(self):
            waited.append(self.k)
            for s in steps:  # a step finishing means every earlier one has finished
                s.done = s.done or s.k <= self.k

    waited, steps = [], []
    bound = InFlight(max_in_flight)
    for k in range(200):
        steps.append(Step(k))
        bound.add(steps[-1], ())
        running = sum(not s.done for s in steps[:-1])  # queued behind the newest step
        assert running <= max_in_flight
    assert waited == sorted(waited)
    gaps = set(np.diff(waited).tolist())
    keep = max(1, max_in_flight // 2)  # left queued after a wait; the next wait comes when full
    assert gaps == {max_in_flight + 1 - keep}, gaps
