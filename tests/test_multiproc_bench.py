"""``benchmarks/multiproc.py``: its plumbing (pairs of processes, rounds, ratios, table), no figure."""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO, run_python

pytestmark = [pytest.mark.multiprocess]


def test_multiproc_bench_runs_pairs_and_prints_ratios():
    proc = run_python([os.path.join(REPO, "benchmarks", "multiproc.py"), "--configs",
                       "hand_flat,per_replica", "--baseline", "hand_flat", "--rounds", "2",
                       "--steps", "4", "--repeats", "1"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| configuration")}
    assert rows["hand_flat"].rstrip().endswith("| 1.00 |")
    float(rows["per_replica"].split("|")[4])  # a ratio, not a failure
    assert "round 1:" in proc.stdout


def test_multiproc_bench_rejects_unknown_configurations():
    proc = run_python([os.path.join(REPO, "benchmarks", "multiproc.py"), "--configs", "nccl"],
                      timeout=60)
    assert proc.returncode != 0 and "unknown ['nccl']" in proc.stderr
