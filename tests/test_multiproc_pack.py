"""Across processes the per-replica view sends its gradients in one flat all-reduce by default."""

from __future__ import annotations

import os

import pytest

from jaxdist import launch
from tests.conftest import REPO

pytestmark = [pytest.mark.multiprocess]


def test_multi_worker_packs_gradients_into_one_all_reduce_with_the_same_result():
    script = os.path.join(REPO, "tests", "_mp_scripts", "pack_across_processes.py")
    res = launch.run([script], num_processes=2, devices_per_process=1, timeout_s=240,
                     grace_period_s=10, env={**os.environ, "PYTHONPATH": REPO,
                                             "PYTHONUNBUFFERED": "1"}, cwd=REPO)
    assert res.returncode == 0, res.output[-3000:]
    for rank in (0, 1):
        # The MLP's six gradient leaves travel as one array (one gloo call), not six.
        assert f"[{rank}] default: pack_bytes=26214400 all-reduced arrays per step 1" in res.output
        assert f"[{rank}] leaves: pack_bytes=None all-reduced arrays per step 6" in res.output
        assert f"[{rank}] process {rank}: params bitwise equal True" in res.output
