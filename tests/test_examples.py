"""Every script in examples/ runs (few steps) and prints what it promises; examples/README.md lists each."""

from __future__ import annotations

import glob
import os
import re
import shlex
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


def readme_commands() -> dict[str, str]:
    """The command examples/README.md gives for each script (its table's last column)."""
    readme = open(os.path.join(REPO, "examples", "README.md")).read()
    rows = re.findall(r"^\|[^|\n]*\| \[`([\w.]+\.py)`\]\([^)]*\) \| `([^`]+)`", readme, re.M)
    return dict(rows)


def _argv(command: str, tmp_path) -> list[str]:
    """The README's command as an argv: optional ``[--flag]`` parts dropped, DIR a fresh folder."""
    words = shlex.split(re.sub(r"\s*\[[^]]*\]", "", command).replace("DIR", str(tmp_path / "d")))
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    assert words[0] == "jaxdist", command
    return [sys.executable, "-m", "jaxdist.cli", *words[1:]]


def _check_default_strategy(out):
    assert re.search(r"DefaultStrategy\(\) +1 replica\(s\) on cpu:0", out), out
    assert re.search(r"OneDeviceStrategy\(last device\) +1 replica\(s\) on cpu:7", out), out
    assert out.count("largest parameter difference") == 2 and _accuracy(out) > 0.9


def _check_tpu(out):
    assert "No TPU here (cpu backend): falling back to MirroredStrategy over 8 cpu devices" in out
    assert 'pip install "jaxdist[tpu]"' in out and "MirroredStrategy: 8 replicas" in out


# What each example promises, run with the defaults (the accuracy bounds are far below what the
# default epochs reach on the digits, ~0.97: they catch a broken run, not a slightly worse one).
CHECKS = {
    "default_strategy.py": _check_default_strategy,
    "mirrored_digits.py": lambda out: "8 replicas" in out and _accuracy(out) > 0.9,
    "custom_loop.py": lambda out: "8 replicas" in out and "epoch 5: loss" in out
    and _accuracy(out) > 0.9,
    "central_storage.py": lambda out: "state in pinned_host memory" in out and _accuracy(out) > 0.9,
    "tpu.py": _check_tpu,
    "parameter_server.py": lambda out: "3 workers, 600 async steps" in out
    and "placement: greedy" in out and _accuracy(out) > 0.9,
    "fault_tolerance.py": lambda out: "bitwise equal to the uninterrupted run: True" in out
    and re.search(r"attempt 1: resumed from memory step \d+", out),
    # The three-host round after the join must train steps: it once resumed at the job's end
    # (the agents agreed to stop at step 42 of 32) and trained none, and the example said True.
    "fault_tolerance_elastic.py": lambda out: re.search(r"round 0: 3 host\(s\)", out)
    and re.search(r"round \d+: 2 host\(s\)", out)
    and re.search(r"the three-host round after the join trained steps \d+\.\.32\b", out)
    and "same parameters as the uninterrupted run (max abs difference" in out
    and re.search(r"steps computed again: [01]\b", out),
    "custom_loop_fault_tolerance.py": lambda out: "attempt 0: fresh start" in out
    and re.search(r"finished at step 36 on \d+ replicas", out) and _accuracy(out) > 0.7,
    "mixed_precision.py": lambda out: "mixed_bfloat16, 4 micro-batches of 64: best checkpoint "
    "test accuracy" in out and _accuracy(out) > 0.9,
    "cnn_mnist.py": lambda out: "CNN, 8 replicas" in out and _accuracy(out) > 0.8,
    "multi_worker.py": lambda out: "[0] 2 processes x 2 devices: test accuracy" in out
    and "[1] 2 processes x 2 devices" not in out,
    "nnx_mlp.py": lambda out: "NNX MLP, 8 replicas" in out and "restored on 1 device" in out
    and _accuracy(out) > 0.8,
    "equinox_mlp.py": lambda out: "relu kept as a static field" in out
    and "restored on 1 device" in out and _accuracy(out) > 0.8,
    "your_own_mesh.py": lambda out: "4 replicas; w1 stays split over 'model': P(None, 'model')"
    in out and "largest parameter difference vs one device" in out and _accuracy(out) > 0.8,
}
SLOW = {"fault_tolerance.py", "fault_tolerance_elastic.py", "multi_worker.py", "mixed_precision.py"}
MULTIPROCESS = {"fault_tolerance.py", "fault_tolerance_elastic.py", "multi_worker.py"}


def _params():
    for name in EXAMPLES:
        marks = ([pytest.mark.slow] if name in SLOW else []) + (
            [pytest.mark.multiprocess] if name in MULTIPROCESS else [])
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_params()))
def test_example_runs_as_examples_readme_says(name, tmp_path):
    command = readme_commands().get(name)
    assert command is not None, f"examples/README.md gives no command for {name}"
    argv = _argv(command, tmp_path)
    scratch = tmp_path / "tmp"  # the example's TMPDIR: what it leaves there is checked below
    scratch.mkdir()
    out = run_python(argv[1:], timeout=600 if name in SLOW else TIMEOUT,
                     env={"TMPDIR": str(scratch)})
    assert out.returncode == 0, f"{command}: exit {out.returncode}\n{out.stdout[-3000:]}\n" \
                                f"{out.stderr[-3000:]}"
    result = CHECKS[name](out.stdout)
    assert result is None or result, f"{command} did not print what it promises:\n" \
                                     f"{out.stdout[-3000:]}"
    # mixed_precision.py left a jaxdist-mp-* checkpoint folder in /tmp on every run; a backup
    # (multi_worker.py's, in the temporary directory by default) is deleted after success. (A launcher's
    # jaxdist-state-* folder, /dev/shm where there is one, and its jaxdist-xla-cache-* compile
    # cache outlive a launcher the fault-tolerance examples SIGKILL on purpose; the next launcher
    # removes those whose launcher is gone.)
    left = sorted(p.name for p in scratch.glob("jaxdist-*")
                  if not p.name.startswith(("jaxdist-state-", "jaxdist-xla-cache-")))
    assert not left, f"{command} left {left} in its temporary directory"


def test_tpu_example_without_a_tpu_exits_2_when_asked_to():
    strict = run_python(["examples/tpu.py", "--require-tpu"], timeout=TIMEOUT)
    assert strict.returncode == 2 and "TPUStrategy found no TPU" in strict.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_parameter_server_as_processes():
    out = _run(["examples/parameter_server.py", "--processes", "--steps", "40"])
    assert "3 workers, 40 async steps" in out


def test_every_example_has_a_readme_command_and_a_check():
    commands = readme_commands()
    assert sorted(commands) == EXAMPLES, "examples/README.md's table must list every script"
    assert sorted(CHECKS) == EXAMPLES
    for name, command in commands.items():
        assert f"examples/{name}" in command, (name, command)
