"""``benchmarks/peers.py --quick``: runs with none of the peers installed, and says so per row.

A smoke test of the benchmark's plumbing (subprocess per peer, rounds, table, report), not a
measurement: no figure is asserted.
"""

from __future__ import annotations

import importlib.util
import os

import jax

from tests.conftest import REPO, run_python


def test_peers_quick_runs_and_reports_absent_peers(tmp_path):
    proc = run_python([os.path.join(REPO, "benchmarks", "peers.py"), "--quick", "--layouts", "8",
                       "--out", str(tmp_path)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "peers.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| MLP, 8 devices"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    labels = ["hand", "global", "per_replica", "fit", "tf_mirrored", "keras_dp", "torch_ddp"]
    got = dict(zip(labels, cells))
    assert got["hand"] == "1.00"
    for name in ("global", "per_replica", "fit"):  # jaxdist itself always runs
        float(got[name])
    for name, module in (("tf_mirrored", "tensorflow"), ("keras_dp", "keras")):
        if importlib.util.find_spec(module) is None:
            assert got[name] == "not installed"
    assert got["torch_ddp"] == "n/a"  # no simulated devices in torch
    assert "2 CPU cores" in report or "CPU cores" in report
    assert f"jax {jax.__version__}" in report  # the JAX the benchmark ran on, whichever it is


def test_peers_rejects_unknown_names():
    proc = run_python([os.path.join(REPO, "benchmarks", "peers.py"), "--peers", "mxnet"], timeout=60)
    assert proc.returncode != 0 and "unknown ['mxnet']" in proc.stderr
