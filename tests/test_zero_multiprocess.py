"""zero_stage across real processes: 2 processes x 2 devices under `jaxdist launch` (gloo)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxdist import launch
from tests.conftest import REPO, run_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = os.path.join(REPO, "tests", "_scripts", "zero_train.py")
ENV = {"PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}


def test_2x2_processes_every_stage_trains_like_stage_0_on_one_process(tmp_path):
    out = tmp_path / "mp.npz"
    res = launch.run([SCRIPT, "--out", str(out)], num_processes=2, devices_per_process=2,
                     timeout_s=300, grace_period_s=10, env=ENV, cwd=REPO)
    assert res.returncode == 0, res.output[-3000:]
    proc = run_python([SCRIPT, "--out", str(tmp_path / "one.npz"), "--stages", "0"], timeout=240,
                      devices=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mp, one = np.load(out), np.load(tmp_path / "one.npz")
    keys = [k[1:] for k in one.files if k.startswith("0[")]
    assert len(keys) == 6
    for stage in range(4):
        assert int(mp[f"step{stage}"]) == 14
        for k in keys:
            np.testing.assert_allclose(mp[f"{stage}{k}"], one[f"0{k}"], rtol=2e-5, atol=2e-5,
                                       err_msg=f"stage {stage} {k}")
    # Optimizer state per device: ~1/4 of stage 0's from stage 1 on (small leaves replicated).
    for stage in (1, 2, 3):
        assert mp[f"bytes{stage}"] < 0.3 * mp["bytes0"]
