"""``benchmarks/sharding.py``: its plumbing (every stage timed, bytes and collectives read, the
stages' parameters checked against stage 0's), no figure."""

from __future__ import annotations

import os

from tests.conftest import REPO, run_python


def test_sharding_bench_prints_every_stage():
    proc = run_python([os.path.join(REPO, "benchmarks", "sharding.py"), "--devices", "2",
                       "--reps", "1", "--steps", "2", "--batch", "64", "--hidden", "64"],
                      timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "|---" not in line]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["0", "1", "2", "3"]
    assert "1 all-reduce" in rows[1] and "all-gather" in rows[2]
    assert "stages 1-3 equal stage 0's to 2e-5 (checked)" in proc.stdout
