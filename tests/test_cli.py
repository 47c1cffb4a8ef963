"""The main job end to end: ``jaxdist train`` in a subprocess."""

from __future__ import annotations

import pytest

from tests.conftest import run_python


@pytest.mark.slow
def test_train_mirrored_on_8_simulated_devices_reaches_good_accuracy():
    proc = run_python(["-m", "jaxdist.cli", "train", "--strategy", "mirrored", "--devices", "8",
                       "--epochs", "8"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MirroredStrategy over 8 cpu device(s)" in proc.stdout
    assert "epoch   8:" in proc.stdout
    acc = float(proc.stdout.rsplit("test accuracy:", 1)[1])
    assert acc >= 0.95
    assert "epoch 1/8" in proc.stderr  # the progress bar


@pytest.mark.parametrize("strategy", ["default", "one_device"])
def test_train_other_strategies_and_cnn(strategy):
    proc = run_python(["-m", "jaxdist.cli", "train", "--strategy", strategy, "--model", "cnn",
                       "--epochs", "1", "--quiet"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test accuracy:" in proc.stdout


def test_train_bad_arguments():
    proc = run_python(["-m", "jaxdist.cli", "train", "--devices", "8", "--batch-size", "100",
                       "--quiet"], timeout=120)
    assert proc.returncode != 0
    assert "--batch-size 100 must be a multiple of the 8 replicas" in proc.stderr
    proc = run_python(["-m", "jaxdist.cli", "train", "--dataset", "mnist"], timeout=120)
    assert proc.returncode != 0 and "needs --data-dir" in proc.stderr
