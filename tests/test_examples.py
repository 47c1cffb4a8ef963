"""Every script in examples/ runs (few steps) and prints what it promises; examples/README.md lists each."""

from __future__ import annotations

import glob
import os
import re
import sys

import pytest

from tests.conftest import REPO, run_python

EXAMPLES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "examples", "*.py")))
TIMEOUT = 300


def _run(args, timeout=TIMEOUT):
    out = run_python(args, timeout=timeout)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _accuracy(stdout):
    return float(re.findall(r"test accuracy (\d\.\d+)", stdout)[-1])


def test_default_and_one_device():
    out = _run(["examples/default_strategy.py", "--epochs", "2"])
    assert re.search(r"DefaultStrategy\(\) +1 replica\(s\) on cpu:0", out), out
    assert re.search(r"OneDeviceStrategy\(last device\) +1 replica\(s\) on cpu:7", out), out
    assert out.count("largest parameter difference") == 2 and _accuracy(out) > 0.8


def test_mirrored_decorator_and_fit():
    out = _run(["examples/mirrored_digits.py", "--epochs", "2"])
    assert "8 replicas" in out and _accuracy(out) > 0.8


def test_custom_loop():
    out = _run(["examples/custom_loop.py", "--epochs", "2", "--devices", "4"])
    assert "4 replicas" in out and "epoch 2: loss" in out and _accuracy(out) > 0.8


def test_central_storage():
    out = _run(["examples/central_storage.py", "--epochs", "2"])
    assert "state in pinned_host memory" in out and _accuracy(out) > 0.8


def test_tpu_example_falls_back_with_a_clear_message_without_a_tpu():
    out = _run(["examples/tpu.py", "--epochs", "1"])
    assert "No TPU here (cpu backend): falling back to MirroredStrategy over 8 cpu devices" in out
    assert 'pip install "jaxdist[tpu]"' in out and "MirroredStrategy: 8 replicas" in out
    strict = run_python(["examples/tpu.py", "--require-tpu"], timeout=TIMEOUT)
    assert strict.returncode == 2 and "TPUStrategy found no TPU" in strict.stderr


def test_parameter_server_in_process():
    out = _run(["examples/parameter_server.py", "--steps", "40"])
    assert "3 workers, 40 async steps" in out and "placement: greedy" in out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parameter_server_as_processes():
    out = _run(["examples/parameter_server.py", "--processes", "--steps", "40"])
    assert "3 workers, 40 async steps" in out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fault_tolerance_kills_a_worker_and_resumes_exactly():
    out = _run(["examples/fault_tolerance.py", "--epochs", "2", "--kill-at", "7"], timeout=500)
    assert "rank 1 was killed by SIGKILL" in out or "attempt 1: resumed from" in out
    # the in-memory tier: the step the killed rank completed (7), or the one before it
    assert re.search(r"attempt 1: resumed from memory step [67], finished at step 16", out), out
    assert "bitwise equal to the uninterrupted run: True" in out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_elastic_fault_tolerance_loses_a_host_and_takes_a_new_one():
    out = _run(["examples/fault_tolerance_elastic.py"], timeout=600)
    assert re.search(r"round 1: 2 host\(s\)", out), out
    assert re.search(r"round 2: 3 host\(s\)", out), out
    assert "same parameters as the uninterrupted run (max abs difference" in out, out
    assert "steps computed again: 0" in out or "steps computed again: 1" in out, out


def test_cnn_on_mnist_idx_files_written_from_digits(tmp_path):
    data = tmp_path / "mnist"
    out = _run(["examples/cnn_mnist.py", "--data-dir", str(data), "--write-from-digits",
                "--epochs", "1", "--limit", "512"])
    assert sorted(os.listdir(data)) == ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte",
                                        "train-images-idx3-ubyte", "train-labels-idx1-ubyte"]
    assert "train (512, 28, 28, 1)" in out and "CNN, 8 replicas" in out and _accuracy(out) > 0.3


# Examples whose smoke test lives next to the feature they show (not repeated here).
TESTED_ELSEWHERE = {"multi_worker.py": "test_multi_worker.py",  # under jaxdist launch, 2 x 2
                    "mixed_precision.py": "test_precision.py"}


def test_every_example_is_listed_in_examples_readme_and_smoke_tested():
    readme = open(os.path.join(REPO, "examples", "README.md")).read()
    tests = open(__file__).read()
    for name in EXAMPLES:
        assert f"`python examples/{name}" in readme or f"examples/{name}`" in readme, name
        if name in TESTED_ELSEWHERE:
            other = open(os.path.join(REPO, "tests", TESTED_ELSEWHERE[name])).read()
            assert f'"examples", "{name}"' in other or f'"examples/{name}"' in other, name
        else:
            assert f'"examples/{name}"' in tests, f"{name} has no smoke test"
