"""Test setup: 8 simulated CPU devices, a compile counter, and a subprocess runner with a timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import jax
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_compiles = [0]


def _on_event(name, *_, **__):
    if name == "/jax/core/compile/backend_compile_duration":
        _compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


@pytest.fixture
def count_compiles():
    """``with count_compiles() as c: ...; c()`` gives the XLA compilations inside the block.

    JAX times ``compile_or_get_cached`` under this event, so a compilation the suite's persistent
    cache served counts too: the count is the same with the cache warm or cold."""

    @contextlib.contextmanager
    def counter():
        start = _compiles[0]
        yield lambda: _compiles[0] - start

    return counter


def run_python(code_or_args, *, timeout: float, env: dict | None = None,
               devices: int | None = None) -> subprocess.CompletedProcess:
    """Runs Python in a subprocess with the checkout importable; fails the test on timeout."""
    full_env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", **(env or {})}
    if devices is not None:
        full_env["JAX_NUM_CPU_DEVICES"] = str(devices)
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else list(code_or_args)
    # In a session of its own: on a timeout its whole group is killed, the processes it started
    # too (a hung benchmark's workers once outlived their parent and the run, and held on)
    with subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=full_env, cwd=REPO, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"subprocess did not finish within {timeout}s (a hang or deadlock); "
                        f"output:\n{out[-3000:]!r}\n{err[-3000:]!r}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="session")
def digits():
    from jaxdist import datasets

    return datasets.digits()


@pytest.fixture
def devices():
    return jax.devices()


@pytest.fixture(scope="session")
def elastic_reference(tmp_path_factory):
    """The elastic tests' uninterrupted job, run once for every module that compares with it."""
    from tests.test_elastic_multihost import reference_run

    return reference_run(tmp_path_factory)


@pytest.fixture(scope="session")
def train_resume_1x4(tmp_path_factory):
    """``tests/_scripts/train_resume.py``'s uninterrupted run in one process on 4 devices, default
    options: the reference that test_checkpoint, test_multi_worker and test_steps_per_execution
    compare with (run once per session; it was run three times)."""
    folder = tmp_path_factory.mktemp("train_resume_1x4")
    out = folder / "one.npz"
    proc = run_python([os.path.join(REPO, "tests", "_scripts", "train_resume.py"), "--backup",
                       str(folder / "backup"), "--out", str(out)], timeout=240, devices=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out
