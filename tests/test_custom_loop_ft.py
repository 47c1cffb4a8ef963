"""A custom training loop gets fit's fault tolerance from TieredCheckpointManager: the example
examples/custom_loop_fault_tolerance.py under `jaxdist launch -n 2`, process 1 SIGKILLed mid-run,
resumes from memory (saying so, and why, in one line) and ends on the parameters of a run that
never failed."""

import os
import pathlib
import re

import numpy as np
import pytest

from jaxdist import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "custom_loop_fault_tolerance.py")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
KILL_AT = 7  # mid-epoch (12 steps an epoch), after the backup of step 5 (--backup-every 5)


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("TF_CONFIG", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS"):
        env.pop(name, None)
    # A copy every step, whatever the loaded test machine measures: the step resumed from is then
    # the one process 1 completed (or the one before, when its copy was still in flight).
    env["JAXDIST_MEMORY_TIER_EVERY"] = "1"
    return env


def _run(tmp_path, name, *args, **options):
    out = tmp_path / f"{name}.npz"
    result = launch.run([EXAMPLE, "--backup", str(tmp_path / f"backup-{name}"), "--out", str(out),
                         *args], num_processes=2, devices_per_process=2, timeout_s=300, env=_env(),
                        **options)
    assert result.returncode == 0, result.output
    with np.load(out) as f:
        params = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
    return result.output, params


def test_a_custom_loop_killed_mid_run_resumes_from_memory_and_ends_as_if_never_killed(tmp_path):
    whole, reference = _run(tmp_path, "whole")
    assert "[0] attempt 0: fresh start" in whole and "restored step" not in whole
    killed, params = _run(tmp_path, "killed", "--kill-at", str(KILL_AT), max_restarts=1)
    assert "rank 1 was killed by SIGKILL (9); restarting the group" in killed
    # One line per process says which tier and why: memory, newer than the backup's step 5.
    said = re.findall(r"^\[(\d)\] .*restored step (\d+) from (\w+) \(epoch 0, batch \2\): (.*)$",
                      killed, re.M)
    assert sorted(rank for rank, *_ in said) == ["0", "1"], killed
    (step, source, why), = {tuple(s[1:]) for s in said}
    assert source == "memory" and why == "the backup's newest step is 5", said
    assert KILL_AT - 1 <= int(step) <= KILL_AT, f"{KILL_AT - int(step)} steps computed again"
    assert f"[0] attempt 1: resumed from memory step {step}" in killed
    assert "[0] finished at step 36" in killed and "[0] finished at step 36" in whole
    # Exact, not a tolerance: on CPU the resumed run repeats the same float32 operations in the
    # same order from the restored state and input position (DESIGN: resume is exact).
    assert len(params) == len(reference)
    for got, want in zip(params, reference):
        np.testing.assert_array_equal(got, want)
    # Both runs completed: each removed its backup (finish(delete=True)).
    assert not (tmp_path / "backup-whole").exists() and not (tmp_path / "backup-killed").exists()
