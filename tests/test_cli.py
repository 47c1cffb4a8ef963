"""The main job end to end: ``jaxdist train`` in a subprocess."""

from __future__ import annotations

import os

import pytest

import jaxdist
import jaxdist.cli
from tests.conftest import REPO, run_python


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


def _in_process(argv, capsys):
    """``jaxdist ARGV`` in this process: (exit code, stdout, stderr)."""
    try:
        code = jaxdist.cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    if isinstance(code, str):  # sys.exit(message), as `python -m jaxdist.cli` ends: exit code 1
        code, err = 1, err + code + "\n"
    return code, out, err


def _one_line_in_process(argv, capsys, text):
    code, _, err = _in_process(argv, capsys)
    assert code not in (0, None), (argv, err)
    err = err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and text in err, err


# (train's argument mistakes, --batch-size 100 on 8 replicas and --dataset mnist without
# --data-dir among them, are MISTAKES below, in-process; one real process checks that no
# traceback escapes: test_a_mistake_in_a_real_process_is_one_line_with_no_traceback)


def test_bench_lists_and_validates_names(capsys):
    code, out, _ = _in_process(["bench", "--help"], capsys)
    assert code == 0 and "overhead" in out and "checkpoint" in out
    code, _, err = _in_process(["bench", "nope"], capsys)
    assert code not in (0, None) and "no benchmark 'nope'" in err


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


def test_missing_directories_give_one_line_errors(capsys):
    _one_line_in_process(["train", "--dataset", "mnist", "--data-dir", "/missing", "--quiet"],
                         capsys, "/missing")
    _one_line_in_process(["bench", "checkpoint", "--dir", "/missing"], capsys,
                         "--dir /missing is not a directory")
    _one_line_in_process(["train", "--model", "no_such_mod:make", "--quiet"], capsys,
                         "cannot import 'no_such_mod'")


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
    assert (f"[0] jaxdist {jaxdist.__version__}: MultiWorkerMirroredStrategy over 4 cpu device(s) "
            "in 2 process(es)") in out
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
def test_train_data_errors_are_one_line_messages(tmp_path, monkeypatch, capsys, factory, text):
    # before: labels 0/200 trained a 201-class model and exited 0; a raising factory, an empty
    # or unpaired split ended in tracebacks ("zero-size array to reduction operation maximum")
    from jaxdist.training import cli as train_cli

    (tmp_path / "bad_data.py").write_text(BAD_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = _train_args(data=f"bad_data:{factory}")
    with pytest.raises(SystemExit) as e:
        (x, y), (xt, yt) = train_cli._load_data(args)
        train_cli._num_classes(args, y, yt)
    msg = capsys.readouterr().err
    assert e.value.code == 2  # argparse's status for a mistake in the arguments
    assert msg.startswith("jaxdist train: error: --data bad_data:") and len(msg.splitlines()) == 1
    assert text in msg, msg


def test_mnist_labels_outside_its_ten_classes_are_refused(tmp_path, capsys):
    # before: IDX labels of 200 sized a 201-class model; training exited 0, test accuracy 0.0000
    import numpy as np

    from tests.test_datasets import _write_idx

    for split, n in (("train", 32), ("t10k", 8)):
        _write_idx(str(tmp_path / f"{split}-images-idx3-ubyte"), np.zeros((n, 28, 28), np.uint8),
                   False)
        _write_idx(str(tmp_path / f"{split}-labels-idx1-ubyte"),
                   np.full(n, 200 if split == "train" else 3, np.uint8), False)
    _one_line_in_process(["train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--quiet",
                          "--epochs", "1"], capsys,
                         "--dataset mnist: train labels include 200, but this dataset has 10 classes")


# --- issue 30: every mistake a newcomer makes on the command line is one line, before any work ---

# (argv, what the one line must say). ``FILE`` becomes a file that exists, ``DIR`` a directory.
MISTAKES = [
    # jaxdist train: bad numbers, zero, negative, not a number
    ("train --batch-size 0", "argument --batch-size: expected a whole number >= 1 (e.g. 128), got 0"),
    ("train --batch-size -5", "argument --batch-size: expected a whole number >= 1"),
    ("train --batch-size abc", "argument --batch-size: expected a whole number"),
    ("train --batch-size 12.5", "argument --batch-size: expected a whole number"),
    ("train --batch-size 100 --devices 8",
     "--batch-size 100 must be a multiple of the 8 replicas (e.g. --batch-size 96)"),
    ("train --epochs 0", "argument --epochs: expected a whole number >= 1 (e.g. 10), got 0"),
    ("train --epochs -1", "argument --epochs: expected a whole number >= 1"),
    ("train --epochs 2.5", "argument --epochs: expected a whole number"),
    ("train --epochs ten", "argument --epochs: expected a whole number"),
    ("train --learning-rate -1", "argument --learning-rate: expected a number > 0 (e.g. 1e-3)"),
    ("train --learning-rate 0", "argument --learning-rate: expected a number > 0"),
    ("train --learning-rate abc", "argument --learning-rate: expected a number > 0"),
    ("train --learning-rate nan", "argument --learning-rate: expected a number > 0"),
    ("train --learning-rate inf", "argument --learning-rate: expected a number > 0"),
    ("train --devices 0", "argument --devices: expected a whole number >= 1 (e.g. 8), got 0"),
    ("train --devices -2", "argument --devices: expected a whole number >= 1"),
    ("train --devices two", "argument --devices: expected a whole number >= 1"),
    ("train --accumulate 0", "argument --accumulate: expected a whole number >= 1"),
    ("train --accumulate -1", "argument --accumulate: expected a whole number >= 1"),
    ("train --accumulate 3",
     "--batch-size 128 must be a multiple of --accumulate 3 (e.g. --batch-size 129)"),
    ("train --devices 8 --accumulate 4 --batch-size 80",
     "--batch-size 80 must be a multiple of the 8 replicas x --accumulate 4 (e.g. --batch-size 64)"),
    ("train --zero-stage 4", "argument --zero-stage: expected a whole number from 0 to 3"),
    ("train --zero-stage -1", "argument --zero-stage: expected a whole number from 0 to 3"),
    ("train --zero-stage 1 --strategy central_storage",
     "--zero-stage 1 needs --strategy mirrored, multi_worker or tpu"),
    ("train --seed -1", "argument --seed: expected a whole number from 0 to"),
    ("train --seed abc", "argument --seed: expected a whole number from 0 to"),
    # typos: choices, flags, subcommands
    ("train --strategy mirored", "argument --strategy: invalid choice: 'mirored'"),
    ("train --strategy TPU", "(did you mean 'tpu'?)"),
    ("train --precision fp16", "argument --precision: invalid choice: 'fp16'"),
    ("train --precision bfloat16", "(did you mean 'mixed_bfloat16'?)"),
    ("train --dataset cifar10", "argument --dataset: invalid choice: 'cifar10'"),
    ("train --batchsize 64", "unrecognized arguments: --batchsize 64 (did you mean --batch-size?)"),
    ("train --epoch-count 3", "unrecognized arguments: --epoch-count 3"),
    ("train --lr 0.1", "unrecognized arguments: --lr 0.1"),
    ("train 5", "unrecognized arguments: 5"),
    ("train --epochs", "argument --epochs: expected one argument"),
    ("trian", "argument COMMAND: invalid choice: 'trian'"),
    ("", "the following arguments are required: COMMAND"),
    # models, data, directories
    ("train --model resnet", "argument --model: expected mlp, cnn or MODULE:FACTORY"),
    ("train --model mypkg.models", "argument --model: expected mlp, cnn or MODULE:FACTORY"),
    ("train --data mydata", "argument --data: expected MODULE:FACTORY (e.g. mypkg.data:load)"),
    ("train --dataset mnist", "--dataset mnist needs --data-dir DIR"),
    ("train --dataset mnist --data-dir /no/such/dir",
     "argument --data-dir: /no/such/dir is not a directory (it does not exist)"),
    ("train --dataset mnist --data-dir FILE", "argument --data-dir: FILE is not a directory"),
    ("train --resume", "--resume needs --checkpoint-dir DIR"),
    ("train --checkpoint-dir /no/such/dir/ckpt",
     "argument --checkpoint-dir: the parent directory /no/such/dir of /no/such/dir/ckpt does not"),
    ("train --checkpoint-dir FILE", "argument --checkpoint-dir: FILE is a file"),
    ("train --tensorboard /no/such/dir/tb", "argument --tensorboard: the parent directory"),
    ("train --strategy tpu --devices 8", "--strategy tpu runs on every TPU core; drop --devices 8"),
    # jaxdist plan: sizes and times with units, bounds, links
    ("plan", "give --model {mlp,cnn,MODULE:FACTORY} or --param-bytes"),
    ("plan --param-bytes 100MB", "give --step-time (one device's step, e.g. --step-time 12ms)"),
    ("plan --param-bytes 100XB --step-time 12ms", "argument --param-bytes: unknown unit 'XB'"),
    ("plan --param-bytes -1 --step-time 12ms", "argument --param-bytes: expected a size"),
    ("plan --param-bytes 0 --step-time 12ms", "argument --param-bytes: expected a size > 0"),
    ("plan --param-bytes abc --step-time 12ms", "argument --param-bytes: expected a size"),
    ("plan --param-bytes 100MB --step-time 12xs", "argument --step-time: unknown unit 'xs'"),
    ("plan --param-bytes 100MB --step-time 0", "argument --step-time: expected a time > 0"),
    ("plan --param-bytes 100MB --step-time=-3ms",
     "argument --step-time: expected a time > 0 (e.g. 12ms), got -3ms"),
    ("plan --param-bytes 100MB --step-time 12ms --fixed-time 20ms",
     "--fixed-time 0.02 must be less than --step-time 0.012"),
    ("plan --param-bytes 100MB --step-time 12ms --hosts 0", "argument --hosts: expected a whole"),
    ("plan --param-bytes 100MB --step-time 12ms --hosts 4",
     "--hosts 4 needs --inter, the link between hosts (e.g. --inter ethernet-25g"),
    ("plan --param-bytes 100MB --step-time 12ms --devices-per-host 0",
     "argument --devices-per-host: expected a whole number >= 1"),
    ("plan --param-bytes 100MB --step-time 12ms --batch 0", "argument --batch: expected a whole"),
    ("plan --param-bytes 100MB --step-time 12ms --leaves 0", "argument --leaves: expected a whole"),
    ("plan --param-bytes 100MB --step-time 12ms --overlap 1.5",
     "argument --overlap: expected a number >= 0 and <= 1"),
    ("plan --param-bytes 100MB --step-time 12ms --target-efficiency 0",
     "argument --target-efficiency: expected a number > 0 and <= 1"),
    ("plan --param-bytes 100MB --step-time 12ms --compute-parallelism 0",
     "argument --compute-parallelism: expected a number > 0"),
    ("plan --param-bytes 100MB --step-time 12ms --device-memory 0",
     "argument --device-memory: expected a size > 0"),
    ("plan --param-bytes 100MB --step-time 12ms --device-memory 16XB",
     "argument --device-memory: unknown unit 'XB'"),
    ("plan --param-bytes 100MB --step-time 12ms --intra nvlnk3",
     "argument --intra: invalid choice: 'nvlnk3'"),
    ("plan --param-bytes 100MB --step-time 12ms --intra measured",
     "--intra measured needs --calibrate"),
    ("plan --model mlp --calibrate --calibrate-devices 1",
     "argument --calibrate-devices: expected a whole number >= 2"),
    ("plan --model resnet --step-time 12ms", "argument --model: expected mlp, cnn or MODULE:FACTORY"),
    ("plan --paramBytes 100MB", "unrecognized arguments: --paramBytes 100MB (did you mean "
     "--param-bytes?)"),
    # jaxdist evaluate
    ("evaluate", "the following arguments are required: --watch"),
    ("evaluate --watch /no/such/dir/ckpt", "argument --watch: the parent directory /no/such/dir"),
    ("evaluate --watch DIR --poll 0", "argument --poll: expected a time > 0 (e.g. 1s), got 0"),
    ("evaluate --watch DIR --poll 5xs", "argument --poll: unknown unit 'xs'"),
    ("evaluate --watch DIR --timeout -1", "argument --timeout: expected a time"),
    ("evaluate --watch DIR --batch-size 0", "argument --batch-size: expected a whole number >= 1"),
]


@pytest.fixture
def no_work(monkeypatch):
    """Makes any work a command could start (loading data, starting JAX, measuring) fail the test:
    a mistake must be reported before it."""
    import jax

    from jaxdist.plan import measure
    from jaxdist.training import cli as train_cli

    def work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(jax.config, "update", work)
    monkeypatch.setattr(jax, "local_devices", work)
    for name in ("_load_data", "_select_devices", "_strategy", "_callbacks"):
        monkeypatch.setattr(train_cli, name, work)
    for name in ("model_size", "factory_size", "measure_step", "measure_allreduce", "recommend"):
        monkeypatch.setattr(measure, name, work)


def _main_error(argv: list[str], capsys) -> str:
    from jaxdist import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2, (argv, e.value.code, err)
    assert out == "" and len(err.strip().splitlines()) == 1, (argv, err)
    return err.strip()


@pytest.mark.parametrize("command, text", MISTAKES, ids=[m[0] or "(nothing)" for m in MISTAKES])
def test_every_mistake_is_one_line_naming_the_flag_before_any_work(command, text, tmp_path,
                                                                  capsys, no_work):
    # before: tracebacks (--epochs 0: KeyError 'loss'; --batch-size 0: ValueError from distribute;
    # --param-bytes 100MB: could not convert string to float), silent training (--learning-rate -1
    # trained to a loss of 4e7) and argparse's usage block above each error
    file = tmp_path / "a_file"
    file.write_text("")
    argv = command.replace("FILE", str(file)).replace("DIR", str(tmp_path)).split()
    err = _main_error(argv, capsys)
    text = text.replace("FILE", str(file))
    assert text in err, err
    assert err.startswith(("jaxdist train: error: ", "jaxdist plan: error: ",
                           "jaxdist evaluate: error: ", "jaxdist: error: ")), err
    assert len(MISTAKES) >= 46


def test_a_batch_larger_than_the_training_set_is_refused(capsys, monkeypatch):
    # before: --batch-size 5000 on the 1,438 digits padded to one step an epoch and ended at 0.12
    # accuracy without a word. Refused (exit 2) once the data is loaded, before any training.
    from jaxdist.training import fit as loop

    def work(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(loop, "fit", work)  # what `jaxdist train` calls
    err = _main_error(["train", "--batch-size", "5000"], capsys)
    assert ("--batch-size 5000 is more than the 1438 training examples of digits: each epoch would "
            "be one step, mostly padding; use at most 1438 (e.g. --batch-size 128)") in err


def test_strategy_tpu_is_a_choice_and_without_a_tpu_one_line(capsys, monkeypatch):
    from jaxdist.training import fit as loop

    monkeypatch.setattr(loop, "fit", lambda *a, **k: pytest.fail("training started"))
    err = _main_error(["train", "--strategy", "tpu"], capsys)
    assert err.startswith("jaxdist train: error: --strategy tpu: no TPU here (JAX's backend is "
                          "cpu)") and "--strategy mirrored" in err


def test_sizes_and_times_take_units_everywhere(capsys):
    from jaxdist import cli
    from jaxdist._output import parse_bytes, parse_seconds

    assert cli.main(["plan", "--param-bytes", "100MB", "--step-time", "12ms", "--hosts", "2",
                     "--inter", "ethernet-25g", "--device-memory", "16GiB"]) == 0
    out = capsys.readouterr().out
    assert "95.37 MiB of gradients in 1 leaves; one device: 12.000 ms per step" in out
    assert "25 Gbit/s Ethernet / RoCE between hosts" in out
    assert parse_bytes("1.5 GiB") == 1.5 * 2**30 and parse_seconds("2min") == 120.0
    from jaxdist._output import ArgumentParser
    from jaxdist.training import cli as train_cli

    parser = ArgumentParser(prog="jaxdist")
    train_cli.add_evaluate_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["evaluate", "--watch", "ckpt", "--poll", "500ms", "--timeout", "30min"])
    assert (args.poll, args.timeout) == (0.5, 1800.0)


def test_version_and_help(capsys):
    from jaxdist import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"jaxdist {jaxdist.__version__}"
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "``" not in out, out  # no raw reST
    for command in ("train", "evaluate", "plan", "launch", "ps", "bench"):
        assert f"    {command} " in out, (command, out)


def test_epoch_lines_are_not_printed_under_the_bars_of_a_terminal(monkeypatch):
    # before: each epoch's metrics twice in a terminal, the finished bar and then a line
    import argparse
    import sys

    from jaxdist.training import cli as train_cli

    def tty(stdout: bool, stderr: bool):
        monkeypatch.setattr(sys.stdout, "isatty", lambda: stdout, raising=False)
        monkeypatch.setattr(sys.stderr, "isatty", lambda: stderr, raising=False)

    loud, quiet = argparse.Namespace(quiet=False), argparse.Namespace(quiet=True)
    tty(True, True)
    assert not train_cli._show_epoch_lines(loud)  # the bars show them
    assert train_cli._show_epoch_lines(quiet)  # no bars: the lines are the progress
    tty(False, True)
    assert train_cli._show_epoch_lines(loud)  # stdout to a file or pipe: keep the record


def test_a_mistake_in_a_real_process_is_one_line_with_no_traceback():
    for argv, text in ((["train", "--epochs", "0"], "argument --epochs"),
                       (["plan", "--param-bytes", "100MB"], "give --step-time")):
        proc = run_python(["-m", "jaxdist.cli", *argv], timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        _one_line_error(proc, text)
