"""MultiWorkerMirroredStrategy across real processes (jaxdist launch, gloo collectives)."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import jaxdist
from jaxdist import launch, models
from jaxdist.checkpoint import CheckpointManager
from tests.conftest import REPO, run_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = os.path.join(REPO, "tests", "_scripts", "train_resume.py")
ENV = {"PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}


def _launch(tmp_path, name, *extra, max_restarts=0):
    out = tmp_path / f"{name}.npz"
    res = launch.run([SCRIPT, "--backup", str(tmp_path / f"{name}_backup"), "--out", str(out),
                      *extra], num_processes=2, devices_per_process=2, max_restarts=max_restarts,
                     timeout_s=300, grace_period_s=10, env=ENV, cwd=REPO)
    return res, out


def _params(path):
    f = np.load(path)
    return {k: f[k] for k in f.files if k != "restored"}


def test_2x2_processes_train_like_1x4_and_resume_exactly_after_sigkill(tmp_path, train_resume_1x4):
    # Uninterrupted 2 processes x 2 devices; the epoch's last batch is padded (700 = 7 * 96 + 28).
    res, two_by_two = _launch(tmp_path, "ref")
    assert res.returncode == 0, res.output[-3000:]
    # 1 process x 4 devices, same seed and global batch (the session's run).
    a, b = _params(two_by_two), _params(train_resume_1x4)
    assert int(a["step"]) == int(b["step"]) == 24
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)

    # Rank 1 is SIGKILLed at step 11 of the first attempt: the launcher restarts the group, the
    # job resumes from memory and must end bitwise where the uninterrupted run did.
    res, out = _launch(tmp_path, "killed", "--kill-at", "11", "--signal", "KILL", "--rank", "1",
                       max_restarts=1)
    assert res.returncode == 0, res.output[-3000:]
    assert res.restarts == 1
    c = np.load(out)
    # jaxdist launch's in-memory tier: the step rank 1 completed (11) or the one before, not the
    # last backup on disk (8 or 10)
    assert int(c["restored"]) in (10, 11)
    for k in a:
        np.testing.assert_array_equal(a[k], c[k], err_msg=k)


def test_sigterm_on_one_process_saves_on_all_and_resumes_exactly(tmp_path):
    long = ("--every", "100", "--epochs", "6")  # 48 steps
    res, ref = _launch(tmp_path, "ref", *long)
    assert res.returncode == 0, res.output[-3000:]
    # JAX's preemption service agrees on a step about a second after the signal: slow the steps.
    res, out = _launch(tmp_path, "run", *long, "--kill-at", "5", "--signal", "TERM", "--rank", "1",
                       "--step-sleep", "0.1")
    assert res.returncode == 0, res.output[-3000:]  # a clean exit on every process
    assert "done" not in res.output and not out.exists()
    saved = CheckpointManager(tmp_path / "run_backup").latest_step()
    assert saved is not None and 5 <= saved < 48  # the step all processes agreed on
    res, out = _launch(tmp_path, "run", *long)
    assert res.returncode == 0, res.output[-3000:]
    a, b = _params(ref), _params(out)
    assert int(np.load(out)["restored"]) == saved
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_checkpoint_from_2x2_restores_on_1x8_and_on_1_device(tmp_path):
    res, out = _launch(tmp_path, "ref", "--epochs", "1", "--every", "4", "--keep-backup")
    assert res.returncode == 0, res.output[-3000:]
    mgr = CheckpointManager(tmp_path / "ref_backup")
    step = mgr.latest_step()
    assert step == 8  # the epoch-end backup
    x, _ = jaxdist.datasets.digits()[0]
    target = models.create_train_state(models.MLP(hidden=(32,)), x[:1], seed=0)
    expected = _params(out)
    for strategy in (jaxdist.MirroredStrategy(jax.devices()[:8]), jaxdist.OneDeviceStrategy()):
        restored = mgr.restore(step, target=target, strategy=strategy)
        assert jax.tree.leaves(restored)[0].sharding == strategy.layout.replicated
        flat = {jax.tree_util.keystr(p): v for p, v in
                jax.tree_util.tree_flatten_with_path(jax.device_get(restored.params))[0]}
        for k, v in flat.items():
            np.testing.assert_array_equal(v, expected[k], err_msg=k)
    # ... and back: the 1-device copy saved again restores into 2 processes x 2 devices.
    assert mgr.metadata(step)["data"] == {"epoch": 0, "position": 8}


def test_readme_per_replica_loop_same_parameters_on_1_8_and_2x2_processes(tmp_path):
    script = os.path.join(REPO, "tests", "_mp_scripts", "per_replica_loop.py")
    runs = {}
    for n in (1, 8):
        out = tmp_path / f"one_x{n}.npz"
        proc = run_python([script, str(out)], timeout=240, devices=n)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[f"1x{n}"] = np.load(out)
    out = tmp_path / "two_x2.npz"
    res = launch.run([script, str(out)], num_processes=2, devices_per_process=2, timeout_s=300,
                     grace_period_s=10, env=ENV, cwd=REPO)
    assert res.returncode == 0, res.output[-3000:]
    assert "process 1: 10 steps on 4 replicas" in res.output
    runs["2x2"] = np.load(out)
    assert [int(r["replicas"]) for r in runs.values()] == [1, 8, 4]
    ref = runs["1x1"]
    for name, r in runs.items():
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, err_msg=name)
        for k in ref.files:
            if k.startswith("arr_"):
                np.testing.assert_allclose(r[k], ref[k], rtol=2e-5, atol=2e-6, err_msg=f"{name} {k}")
