"""Checkpoints: reshard on restore, clear errors, atomic saves, exact resume after SIGKILL/SIGTERM."""

from __future__ import annotations

import os
import signal
import textwrap

import jax
import numpy as np
import pytest

import jaxdist
from jaxdist import models
from jaxdist.checkpoint import CheckpointError, CheckpointManager
from tests.conftest import REPO, run_python

SCRIPT = os.path.join(REPO, "tests", "_scripts", "train_resume.py")


def _state(seed=0):
    x, _ = jaxdist.datasets.synthetic(4, shape=(6,))
    return models.create_train_state(models.MLP(hidden=(16,)), x[:1], seed=seed)


def _assert_trees_equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_save_on_8_devices_restore_on_1_and_4(tmp_path):
    saved = jaxdist.MirroredStrategy().put(_state(seed=3))
    mgr = CheckpointManager(tmp_path)
    mgr.save(10, saved)
    mgr.wait_until_finished()
    for target_strategy in (jaxdist.OneDeviceStrategy(jax.devices()[2]),
                            jaxdist.MirroredStrategy(jax.devices()[4:])):
        restored = mgr.restore(target=_state(seed=0), strategy=target_strategy)
        _assert_trees_equal(restored, saved)
        leaf = jax.tree.leaves(restored)[0]
        assert leaf.sharding == target_strategy.layout.replicated


def test_missing_and_corrupt_checkpoints_leave_older_ones_usable(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=False)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        mgr.restore(target=_state())
    first, second = _state(1), _state(2)
    mgr.save(1, first)
    mgr.save(2, second)
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 7 .* available steps: \[1, 2\]"):
        mgr.restore(7, target=_state())
    # Corrupt every data file of step 2.
    for root, _, files in os.walk(tmp_path / "2" / "state"):
        for f in files:
            if not f.startswith("_") and "metadata" not in f:
                with open(os.path.join(root, f), "r+b") as fh:
                    fh.truncate(3)
    with pytest.raises(CheckpointError, match=r"step 2 .* cannot be restored.*steps you can "
                                              r"try instead: \[1\]"):
        mgr.restore(2, target=_state())
    _assert_trees_equal(mgr.restore(1, target=_state()), first)
    # Without a step, the newest step that restores intact (a warning names step 2).
    _assert_trees_equal(mgr.restore(target=_state()), first)
    # A target of the wrong structure is named as such (issue 19: not as damage).
    with pytest.raises(CheckpointError, match=r"does not match the restore target \(the step is "
                                              r"intact.*structure: "):
        mgr.restore(1, target={"w": np.zeros(3)})
    mgr.close()


def test_a_crash_midway_through_a_save_never_yields_a_valid_checkpoint(tmp_path):
    code = textwrap.dedent(f"""
        import os, jax, jax.numpy as jnp
        from jaxdist.checkpoint import CheckpointManager
        mgr = CheckpointManager({str(tmp_path)!r}, async_save=True)
        mgr.save(1, {{"w": jnp.ones(8)}}); mgr.wait_until_finished()
        mgr.save(2, {{"w": jnp.zeros((4096, 4096))}})   # 64 MB written in the background
        os._exit(1)                                      # crash before it commits
    """)
    proc = run_python(code, timeout=120)
    assert proc.returncode == 1
    mgr = CheckpointManager(tmp_path)
    assert mgr.latest_step() == 1
    assert float(mgr.restore(target={"w": np.zeros(8, np.float32)})["w"].sum()) == 8.0


def _train(tmp_path, name, *extra, devices=4):
    out = tmp_path / f"{name}.npz"
    proc = run_python([SCRIPT, "--backup", str(tmp_path / f"{name}_backup"), "--out", str(out),
                       *extra], timeout=240, devices=devices)
    return proc, out


@pytest.mark.slow
def test_sigkill_then_rerun_resumes_exactly(tmp_path, train_resume_1x4):
    ref_out = train_resume_1x4  # the uninterrupted run, 4 devices, default options
    killed, out = _train(tmp_path, "run", "--kill-at", "11", "--signal", "KILL")
    assert killed.returncode == -signal.SIGKILL and not out.exists()
    resumed, out = _train(tmp_path, "run")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = np.load(ref_out), np.load(out)
    # The last durable backup before the kill (every 2 steps; step 10's async write may have been
    # cut off by the kill, and then it must not count).
    assert int(b["restored"]) in (8, 10)
    assert int(a["step"]) == int(b["step"]) == 24
    for k in a.files:
        if k != "restored":
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_and_exits_cleanly(tmp_path):
    ref, ref_out = _train(tmp_path, "ref", "--every", "100")
    preempted, out = _train(tmp_path, "run", "--every", "100", "--kill-at", "13", "--signal", "TERM")
    assert preempted.returncode == 0, preempted.stderr[-2000:]
    assert "done" not in preempted.stdout and not out.exists()
    assert CheckpointManager(tmp_path / "run_backup").latest_step() == 13
    resumed, out = _train(tmp_path, "run", "--every", "100")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = np.load(ref_out), np.load(out)
    assert int(b["restored"]) == 13
    for k in a.files:
        if k != "restored":
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_restore_without_a_strategy_keeps_the_target_layout(tmp_path):
    saved = jaxdist.MirroredStrategy(jax.devices()[:2]).put(_state(seed=4))
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, saved)
        on_device_3 = jax.device_put(_state(), jax.devices()[3])
        restored = mgr.restore(target=on_device_3)
        assert jax.tree.leaves(restored)[0].devices() == {jax.devices()[3]}
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)),
                                _state())
        _assert_trees_equal(mgr.restore(target=abstract), saved)


@pytest.mark.parametrize("steps_per_epoch", [None, 2])
def test_resume_at_an_epoch_boundary_is_exact(tmp_path, steps_per_epoch):
    """A backup written as an epoch ends resumes at the next epoch: no step replayed or added."""
    x, y = jaxdist.datasets.synthetic(40, shape=(6,))
    s = jaxdist.MirroredStrategy(jax.devices()[:2])

    def run(epochs, backup):
        # Kept after success: the short run stands for one killed after epoch 0's backup.
        cbs = ([jaxdist.callbacks.BackupAndRestore(str(backup), delete_checkpoint=False)]
               if backup else [])
        return jaxdist.fit(s.step(models.classifier_train_step), _state(), s.distribute(
            (x, y), 10, shuffle=True), epochs=epochs, steps_per_epoch=steps_per_epoch,
            callbacks=cbs, verbose=0)

    whole = run(3, None)
    run(1, tmp_path / "b")           # "killed" right after epoch 0's backup
    resumed = run(3, tmp_path / "b")
    assert resumed.epochs == [1, 2]
    assert int(resumed.state.step) == int(whole.state.step) == 3 * (steps_per_epoch or 4)
    _assert_trees_equal(resumed.state.params, whole.state.params)
    assert resumed.history["loss"] == whole.history["loss"][1:]
