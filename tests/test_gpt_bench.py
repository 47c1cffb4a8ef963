"""``benchmarks/gpt.py --tiny`` on the CPU: its plumbing, no figure.

Every loop is timed and compared with the hand-written one, the launched runs with the memory tier
on and off report their step times, and every loop (the launched ones included) ends on the
hand-written loop's parameters: the guard that the benchmark compares like with like.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.conftest import REPO, run_python

pytestmark = [pytest.mark.slow]

ROWS = {"hand", "hand_fed", "mirrored", "fit", "zero3", "launch_tier_on", "launch_tier_off"}


def test_gpt_bench_tiny_times_every_loop_and_all_compute_the_same(tmp_path):
    out = tmp_path / "gpt.json"
    # 2 simulated devices, so that zero3 shards and the batch splits. About 40 s of CPU: one
    # in-process run and two launched ones, each compiling (minutes on a loaded machine).
    proc = run_python([os.path.join(REPO, "benchmarks", "gpt.py"), "--tiny", "--devices", "2",
                       "--json", str(out)],
                      timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    summary = res["summary"]

    assert set(summary["rows"]) == ROWS
    for name, row in summary["rows"].items():
        assert f"| {name} | " in proc.stdout, name
        for key in ("tokens_per_s", "ratio_to_hand", "step_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (name, key, row)
    assert math.isfinite(summary["rows"]["fit"]["ratio_to_hand_fed"])

    # The tier's cost: both launched runs ran, one with the tier, one without.
    assert "in-memory tier cost" in proc.stdout
    assert math.isfinite(summary["tier_step_time_ratio"]) and summary["tier_step_time_ratio"] > 0
    (on,), (off,) = res["launch"]["on"], res["launch"]["off"]
    assert on["tier_enabled"] is not False and off["tier_enabled"] is not True, (on, off)
    assert not res.get("launch_errors")

    # Same initial state, same batches in the same order, same steps: the same parameters. On the
    # CPU they agree to rounding; one step more or the batches rotated by one give 0.2 and 0.9.
    same = summary["same_numbers"]
    assert set(same) == {"hand_fed", "mirrored", "fit", "zero3", "launch_on", "launch_off"}
    assert all(v <= 1e-4 for v in same.values()), same
    assert summary["same_numbers_ok"] and "-> OK" in proc.stdout


def test_gpt_bench_tiny_kill_part_resumes_from_memory_within_the_announced_bound(tmp_path):
    # The GPU session's kill part on the CPU: fit + BackupAndRestore under `jaxdist launch -n 1`,
    # SIGKILLed after step 16 of 24 and restarted; replicated state and zero_stage=3
    out = tmp_path / "kill.json"
    proc = run_python([os.path.join(REPO, "benchmarks", "gpt.py"), "--tiny", "--devices", "2",
                       "--parts", "kill", "--deterministic", "--launch-steps", "24",
                       "--json", str(out)], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["kill"]) == {"zero_stage=0", "zero_stage=3"}
    for name, k in res["kill"].items():
        assert k["killed_after"] == 16 and k["resumed_from"] == "memory", (name, k)
        assert 0 <= k["recomputed"] <= k["announced"], (name, k)
        assert k["distance"] <= 1e-6, (name, k)  # the uninterrupted run's parameters
        assert f"SIGKILL under `jaxdist launch -n 1` ({name})" in proc.stdout
    assert res["summary"]["kill_ok"]
