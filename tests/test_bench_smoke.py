"""``benchmarks/overhead.py``, ``benchmarks/cnn_pool.py`` and ``benchmarks/rendezvous_sim.py``: their
plumbing, no figure.

Both benchmarks also check that what they time computes the same thing (every loop of overhead.py
ends with the hand-written loop's parameters; the two poolings of cnn_pool.py train alike), so a
short run here guards that too.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO, run_python

pytestmark = [pytest.mark.slow]


def test_overhead_bench_times_every_loop_and_prints_ratios():
    proc = run_python([os.path.join(REPO, "benchmarks", "overhead.py"), "--devices", "2",
                       "--reps", "2", "--steps", "3", "--batch", "32"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for loop in ("global", "per_replica", "masked", "hand_fed", "distribute", "fit", "fit_k"):
        assert f"{loop} / hand-written steps/s: min" in proc.stdout, loop
    assert "distribute / hand-written fed from host arrays: median" in proc.stdout
    assert "every loop ended on the hand-written loop's parameters (check: final)" in proc.stdout


def test_overhead_bench_tiny_model_prints_the_host_cpu_table_and_target_ratios():
    # The dispatch-bound case of the table: MLP 64-32-10 on the digits, 1 device.
    proc = run_python([os.path.join(REPO, "benchmarks", "overhead.py"), "--model", "tiny",
                       "--reps", "2", "--steps", "10", "--spe", "4", "--check", "highest"],
                      timeout=600)  # ten loops compiled twice (the highest-precision pass)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "1 devices, MLP 64-32-10 on the digits, global batch 32" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines()
            if line.startswith("| ") and " ms |" in line}
    assert set(rows) == {"hand", "global", "per_replica", "readme", "masked", "hand_fed",
                         "distribute", "fit", "fit_k", "fit_iter"}, rows
    for a, b in (("fit", "hand_fed"), ("distribute", "hand_fed"), ("per_replica", "global"),
                 ("readme", "global")):
        assert f"CPU per step {a} / {b}: median" in out, (a, b)
    assert "fit_k (steps_per_execution=4) / fit steps/s: median" in out
    # The GPU's check (a separate pass at the highest matmul precision) runs on CPUs too.
    assert "every loop ended on the hand-written loop's parameters (check: highest)" in out


def test_cnn_pool_bench_compares_both_poolings_per_device_count():
    proc = run_python([os.path.join(REPO, "benchmarks", "cnn_pool.py"), "--devices", "1", "2",
                       "--reps", "2", "--steps", "1", "--batch", "16"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "devices" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "2"]
    for r in rows:
        float(r.split("|")[4].split()[0])  # a speed-up, not a failure


@pytest.mark.parametrize("agents", ["real", "light"])
def test_rendezvous_sim_forms_a_round_and_re_forms_it_after_a_loss(agents):
    # in this process: 8 real agents in threads, or 8 light hosts on an event loop (the
    # simulator's default), the store in a thread (no figure, the plumbing)
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "rendezvous_sim", os.path.join(REPO, "benchmarks", "rendezvous_sim.py"))
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    out = sim.run(8, store="thread", steady_s=0.3, host_timeout_s=1.2, join=agents == "light",
                  agents=agents)
    assert out["round_sizes"] == ([8, 7, 8] if agents == "light" else [8, 7]), out
    assert out["keys"] > 8 and out["steady_calls_per_host_s"] > 0, out
