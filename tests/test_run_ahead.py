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
