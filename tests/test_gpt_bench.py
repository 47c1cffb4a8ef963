"""``benchmarks/gpu_session.sh --dry-run`` on the CPU: the GPU session's every part at tiny sizes.

One run of the session (the input path, the tier on and off, a SIGKILL with replicated state and
``zero_stage=3``, the GPT loops' agreement and timing), with one target planted out of reach: the
session must exit non-zero naming that part, leave at most 8 files (what a GPU call brings back),
one of them an archive holding every part's output and JSON, and every other target must pass
(the verdict run again over the archive without the planted target). No figure is held here: the
plumbing, and the checks that compare like with like, are.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow]

PARTS = ("overhead_mlp", "overhead_tiny", "gpt_launch", "gpt_kill", "gpt_check", "gpt_inproc")
LOOPS = {"hand", "hand_fed", "mirrored", "fit", "zero3"}


def test_the_gpu_session_dry_run_fits_one_call_and_names_a_missed_target(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
           "GPU_TARGETS": "tier.steps_per_s=100"}  # out of reach: the tier part must be named
    # About 2 minutes of CPU here (each part compiles; a shared compilation cache helps).
    try:
        proc = subprocess.run(["bash", "benchmarks/gpu_session.sh", "--dry-run"], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the dry run did not end within 900 s: {(e.stdout or b'')[-3000:]!r}")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 6, said[-4000:]
    assert "MISS in part(s): tier" in said and "MISS  tier.steps_per_s" in said, said[-4000:]

    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_session.tar.gz", "session.log", "summary.txt"], files
    with tarfile.open(out / "gpu_session.tar.gz") as archive:
        archive.extractall(tmp_path / "x", filter="data")
    parts = tmp_path / "x" / "parts"
    for name in PARTS:
        assert (parts / f"{name}.txt").stat().st_size > 0, name
        assert (parts / f"{name}.json").stat().st_size > 0, (name, (parts / f"{name}.txt")
                                                             .read_text()[-3000:])
    log = (parts / "session.log").read_text()
    assert all(f"{name}: exit code 0" in log for name in PARTS), log

    # Without the planted target, every target passes (speeds ask only for a figure here).
    again = subprocess.run([sys.executable, "benchmarks/gpu_verdict.py", str(parts), "--dry-run"],
                           cwd=REPO, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "GPU_TARGETS": ""})
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("PASS  ") == again.stdout.count("\n") - 1, again.stdout

    def load(name):
        return json.loads((parts / f"{name}.json").read_text())

    timing = load("gpt_inproc")["summary"]["rows"]
    assert set(timing) == LOOPS
    for name, row in timing.items():
        for key in ("tokens_per_s", "ratio_to_hand", "step_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (name, key, row)
    # Same initial state, same batches in the same order, same steps: the same parameters. On the
    # CPU they agree to rounding; one step more or the batches rotated by one give 0.2 and 0.9.
    check = load("gpt_check")["summary"]
    assert set(check["same_numbers"]) == LOOPS - {"hand"}
    assert all(v <= 1e-4 for v in check["same_numbers"].values()), check["same_numbers"]

    launch = load("gpt_launch")
    (on,), (off,) = launch["launch"]["on"], launch["launch"]["off"]
    assert on["tier_enabled"] is True and off["tier_enabled"] is not True, (on, off)
    assert on["bounds"] and on["bounds_all"], on  # what the launcher announced
    assert launch["launch_same_numbers"]["launch_on"] <= 1e-4, launch["launch_same_numbers"]

    # SIGKILLed after step 16 of 24 and restarted: from memory, on the uninterrupted run's
    # parameters, with the steps computed again and the bound announced before the kill as
    # figures. Whether the first stays within the second is timing on a CPU shared with another
    # test (a write slower than any the tier had timed: 9 against 8 once in a CI rehearsal); the
    # GPU session holds it, and test_elastic_tier_bound.py checks it in the floor suite.
    kill = load("gpt_kill")["kill"]
    assert set(kill) == {"zero_stage=0", "zero_stage=3"}
    for name, k in kill.items():
        assert k["killed_after"] == 16 and k["resumed_from"] == "memory", (name, k)
        assert 0 <= k["recomputed"] <= 16 and k["announced"] >= 1, (name, k)
        assert k["distance"] <= 1e-6, (name, k)
