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


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_stopped_process_is_declared_hung_and_recovered(tmp_path, reference, zero_stage):
    # before: a SIGSTOPped rank left its peer waiting in a collective until --timeout; with
    # zero_stage=1 it was never named (heartbeats came from the tier, off for sharded state)
    result, params = _run(tmp_path, "stop", "--fault", "stop", "--rank", "1", "--at", "6",
                          "--zero-stage", str(zero_stage), max_restarts=1, hang_timeout_s=4)
    assert re.search(r"rank 1 \(host \S+, pid \d+\) is hung: no completed step for [\d.]+ s "
                     r"\(hang timeout 4 s\), last completed step \d+, process stopped",
                     result.output), result.output
    _check_recovery(result, params, reference, 6)



def test_a_rank_stuck_in_its_own_python_is_named_and_every_stack_shown(tmp_path, reference):
    # before: no rank was named (the heartbeats came from the tier's writer, which kept the peer
    # looking alive while it waited inside the collective) and no stack was shown
    result, params = _run(tmp_path, "stuck", "--fault", "stuck", "--rank", "1", "--at", "5",
                          max_restarts=1, hang_timeout_s=5)
    out = result.output
    assert re.search(r"rank 1 is the one the others wait for: it dispatched \d+ steps, ranks "
                     r"\[0\] dispatched \d+ \(they are blocked inside a collective", out), out
    stacks = out[out.index("their Python stacks follow"):]
    # rank 1's stack shows where it is stuck; rank 0's that it waits inside JAX
    assert re.search(r"\[1\]   File \".*ft_train\.py\", line \d+ in wait_for_input_that_never_comes",
                     stacks), stacks[:3000]
    assert re.search(r"\[0\]   File \".*\", line \d+ in ", stacks)
    _check_recovery(result, params, reference, 5)


def test_sharded_state_zero_3_costs_no_more_than_replicated_state_and_ends_the_same(
        tmp_path, reference):
    # before: zero_stage 1-3 switched the tier off, and a SIGKILL at step 5 recomputed 5 steps
    result, params = _run(tmp_path, "zero3", "--fault", "kill", "--rank", "1", "--at", "5",
                          "--zero-stage", "3", max_restarts=1)
    assert "in-memory tier is off" not in result.output
    _check_recovery(result, params, reference, 5)


def test_a_fault_that_comes_back_stops_the_retries_and_keeps_the_state(tmp_path):
    # before: every restart failed the same way until --max-restarts was spent, and the launcher
    # then deleted the in-memory state
    script = tmp_path / "always_fails.py"
    script.write_text(
        "import os, sys\n"
        "sys.path.insert(0, os.environ['PYTHONPATH'])\n"
        "import runpy\n"
        f"sys.argv = [{SCRIPT!r}, {str(tmp_path / 'o.npz')!r}, {str(tmp_path / 'b')!r}]\n"
        "import jaxdist\n"
        "class Broken(jaxdist.callbacks.Callback):\n"
        "    def on_train_batch_end(self, info):\n"
        "        if info.step >= 3:\n"
        "            raise ValueError('the data from step 3 on is bad')\n"
        "real_fit = jaxdist.fit\n"
        "def fit(*a, callbacks=(), **k):\n"
        "    return real_fit(*a, callbacks=[*callbacks, Broken()], **k)\n"
        "jaxdist.fit = fit\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    result = launch.run([str(script)], num_processes=2, devices_per_process=2, timeout_s=240,
                        env=_env(), max_restarts=5)
    assert result.returncode != 0
    out = result.output
    assert result.restarts == 1, out  # tried again once, not five times
    assert re.search(r"the same failure twice in a row \(rank \d exited with code 1, after step "
                     r"\d+: ValueError: the data from step 3 on is bad\)", out), out
    kept = re.search(r"its in-memory state is kept in (\S+) ", out)
    assert kept and os.path.isdir(kept[1]), out
    import shutil

    shutil.rmtree(kept[1], ignore_errors=True)
