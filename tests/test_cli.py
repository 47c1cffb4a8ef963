"""The main job end to end: ``jaxdist train`` in a subprocess."""

from __future__ import annotations

import os

import pytest

import jaxdist

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


@pytest.mark.parametrize("strategy", ["default", "one_device", "central_storage"])
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


def test_bench_lists_and_validates_names():
    proc = run_python(["-m", "jaxdist.cli", "bench", "--help"], timeout=60)
    assert proc.returncode == 0 and "overhead" in proc.stdout and "checkpoint" in proc.stdout
    proc = run_python(["-m", "jaxdist.cli", "bench", "nope"], timeout=60)
    assert proc.returncode != 0 and "no benchmark 'nope'" in proc.stderr


def test_synthetic_dataset_test_split_shares_the_training_labels():
    # The test split used to come from a different labelling teacher: test accuracy 0.0986.
    proc = run_python(["-m", "jaxdist.cli", "train", "--dataset", "synthetic", "--devices", "8",
                       "--epochs", "5", "--quiet"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.rsplit("test accuracy:", 1)[1]) >= 0.5


def _one_line_error(proc, text):
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and text in err, err


def test_missing_directories_give_one_line_errors():
    _one_line_error(run_python(["-m", "jaxdist.cli", "train", "--dataset", "mnist", "--data-dir",
                                "/missing", "--quiet"], timeout=120), "/missing")
    _one_line_error(run_python(["-m", "jaxdist.cli", "bench", "checkpoint", "--dir", "/missing"],
                               timeout=120), "--dir /missing is not a directory")
    _one_line_error(run_python(["-m", "jaxdist.cli", "train", "--model", "no_such_mod:make",
                                "--quiet"], timeout=120), "cannot import 'no_such_mod'")


def test_train_precision_accumulate_checkpoint_resume_tensorboard(tmp_path):
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    common = ["-m", "jaxdist.cli", "train", "--devices", "4", "--quiet", "--batch-size", "64",
              "--precision", "mixed_float16", "--accumulate", "2", "--checkpoint-dir", str(ckpt)]
    proc = run_python([*common, "--epochs", "2", "--tensorboard", str(tb)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mixed_float16, 2 micro-batches per step" in proc.stdout
    assert any(f.name.startswith("events.out.tfevents") for f in tb.rglob("*"))
    from jaxdist.checkpoint import CheckpointManager

    assert CheckpointManager(ckpt).latest_step() == 2 * 23  # 1438 rows / 64 -> 23 steps an epoch
    # Without --resume a used directory is refused; with it, training continues at epoch 3.
    _one_line_error(run_python([*common, "--epochs", "3"], timeout=120), "pass --resume")
    proc = run_python([*common, "--epochs", "4", "--resume"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "epoch   3:" in proc.stdout and "epoch   1:" not in proc.stdout
    assert "trained 2 epochs" in proc.stdout
    assert float(proc.stdout.rsplit("test accuracy:", 1)[1]) >= 0.9


USER_CODE = '''
import flax.linen as nn
import numpy as np


class Tiny(nn.Module):
    num_classes: int = 3

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.num_classes)(nn.relu(nn.Dense(16)(x)))


def make_model(num_classes):
    return Tiny(num_classes)


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
    return (x[:480], y[:480]), (x[480:], y[480:])
'''


def test_train_own_model_and_data(tmp_path):
    (tmp_path / "user_code.py").write_text(USER_CODE)
    from tests.conftest import REPO

    proc = run_python(["-m", "jaxdist.cli", "train", "--model", "user_code:make_model", "--data",
                       "user_code:make_data", "--devices", "2", "--batch-size", "32", "--epochs",
                       "10", "--learning-rate", "1e-2", "--quiet"], timeout=300,
                      env={"PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "user_code:make_model on user_code:make_data (480 train / 120 test)" in proc.stdout
    assert float(proc.stdout.rsplit("test accuracy:", 1)[1]) >= 0.85


@pytest.mark.multiprocess
def test_train_multi_worker_under_launch_is_one_job():
    proc = run_python(["-m", "jaxdist.cli", "launch", "-n", "2", "--devices-per-process", "2",
                       "-m", "jaxdist.cli", "train", "--strategy", "multi_worker", "--epochs", "2",
                       "--batch-size", "64", "--quiet"], timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"[0] jaxdist {jaxdist.__version__}: MultiWorkerMirroredStrategy over 4 cpu device(s) in 2 process(es)" in out
    assert "[0] test accuracy:" in out and "[1] test accuracy:" not in out
