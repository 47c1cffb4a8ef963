"""Fault tolerance under `jaxdist launch`: a failure costs at most one step, and the job ends on
the parameters of a run that never failed (the in-memory state tier, hang detection)."""

import os
import pathlib
import re

import numpy as np
import pytest

from jaxdist import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "_mp_scripts" / "ft_train.py")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("TF_CONFIG", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS"):
        env.pop(name, None)
    return env


def _run(tmp_path, name, *args, **options):
    out = tmp_path / f"{name}.npz"
    result = launch.run([SCRIPT, str(out), str(tmp_path / f"backup-{name}"), *args],
                        num_processes=2, devices_per_process=2, timeout_s=240,
                        env=_env(), **options)
    assert result.returncode == 0, result.output
    with np.load(out) as f:
        params = [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
    return result, params


def _trained(output: str) -> list[list[tuple[int, int, int]]]:
    """Rank 0's (step, epoch, position) lines, one list per attempt."""
    attempts, current = [], []
    for line in output.splitlines():
        if "restarting the group" in line:
            attempts.append(current)
            current = []
        if m := re.match(r"\[0\] trained step (\d+) epoch (\d+) position (\d+)$", line):
            current.append(tuple(map(int, m.groups())))
    return [*attempts, current]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    result, params = _run(tmp_path_factory.mktemp("ref"), "ref")
    (steps,) = _trained(result.output)
    return steps, params


def _check_recovery(result, params, reference, fault_step):
    ref_steps, ref_params = reference
    first, second = _trained(result.output)
    resumed = int(re.search(r"attempt 1 resumed from memory step (\d+)", result.output)[1])
    # The faulty rank completed `fault_step`; no peer can complete a later one without it.
    assert resumed <= fault_step
    assert fault_step - resumed <= 1, f"{fault_step - resumed} steps computed again"
    # Every batch exactly once: the first attempt up to the resumed step, then the rest.
    assert [s for s in first if s[0] <= resumed] + second == ref_steps
    assert max(float(np.abs(a - b).max()) for a, b in zip(params, ref_params)) <= 2e-5


def test_sigkill_of_one_process_costs_at_most_one_step(tmp_path, reference):
    # before: the group restarted from the last persistent backup (here: from scratch, 5 steps)
    result, params = _run(tmp_path, "kill", "--fault", "kill", "--rank", "1", "--at", "5",
                          max_restarts=1)
    assert "rank 1 was killed by SIGKILL (9); restarting the group" in result.output
    _check_recovery(result, params, reference, 5)


def test_a_stopped_process_is_declared_hung_and_recovered(tmp_path, reference):
    # before: a SIGSTOPped rank left its peer waiting in a collective until --timeout
    result, params = _run(tmp_path, "stop", "--fault", "stop", "--rank", "1", "--at", "6",
                          max_restarts=1, hang_timeout_s=4)
    assert re.search(r"rank 1 \(host \S+, pid \d+\) is hung: no completed step for [\d.]+ s "
                     r"\(hang timeout 4 s\), last completed step \d+, process stopped",
                     result.output), result.output
    _check_recovery(result, params, reference, 6)

