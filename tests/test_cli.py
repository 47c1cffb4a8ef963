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


# --- issue 19: data and labels ----------------------------------------------------------------------

BAD_DATA = """
import numpy as np
def labels_200():
    x = np.zeros((64, 4), np.float32)
    y = np.arange(64) % 2 * 200
    return (x, y), (x[:8], y[:8])
def raises():
    raise KeyError("column 'label' not found")
def empty():
    return (np.zeros((0, 4), np.float32), np.zeros(0, np.int32)), (np.zeros((8, 4)), np.zeros(8, int))
def unseen_test_class():
    x = np.zeros((64, 4), np.float32)
    return (x, np.arange(64) % 3), (x[:8], np.full(8, 5))
def unpaired():
    return (np.zeros((64, 4)), np.zeros(63, int)), (np.zeros((8, 4)), np.zeros(8, int))
"""


def _train_args(**kw):
    import argparse

    return argparse.Namespace(**{"data": None, "dataset": "digits", "data_dir": None, "seed": 0,
                                 **kw})


@pytest.mark.parametrize("factory, text", [
    ("labels_200", "the largest training label is 200 but only 2 distinct labels occur"),
    ("raises", "the factory raised KeyError: \"column 'label' not found\""),
    ("empty", "the train split is empty (0 examples)"),
    ("unseen_test_class", "test labels include 5, but the training labels stop at 2"),
    ("unpaired", "train inputs (64, 4) and labels (63,) do not pair up")])
def test_train_data_errors_are_one_line_messages(tmp_path, monkeypatch, factory, text):
    # before: labels 0/200 trained a 201-class model and exited 0; a raising factory, an empty
    # or unpaired split ended in tracebacks ("zero-size array to reduction operation maximum")
    from jaxdist.training import cli as train_cli

    (tmp_path / "bad_data.py").write_text(BAD_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = _train_args(data=f"bad_data:{factory}")
    with pytest.raises(SystemExit) as e:
        (x, y), (xt, yt) = train_cli._load_data(args)
        train_cli._num_classes(args, y, yt)
    msg = str(e.value.code)
    assert msg.startswith("jaxdist train: --data bad_data:") and len(msg.splitlines()) == 1
    assert text in msg, msg


def test_mnist_labels_outside_its_ten_classes_are_refused(tmp_path):
    # before: IDX labels of 200 sized a 201-class model; training exited 0, test accuracy 0.0000
    import numpy as np

    from tests.test_datasets import _write_idx

    for split, n in (("train", 32), ("t10k", 8)):
        _write_idx(str(tmp_path / f"{split}-images-idx3-ubyte"), np.zeros((n, 28, 28), np.uint8),
                   False)
        _write_idx(str(tmp_path / f"{split}-labels-idx1-ubyte"),
                   np.full(n, 200 if split == "train" else 3, np.uint8), False)
    _one_line_error(run_python(["-m", "jaxdist.cli", "train", "--dataset", "mnist", "--data-dir",
                                str(tmp_path), "--quiet", "--epochs", "1"], timeout=120),
                    "--dataset mnist: train labels include 200, but this dataset has 10 classes")
