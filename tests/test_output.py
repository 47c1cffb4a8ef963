"""Quiet, informative output: no gloo chatter from `jaxdist launch` unless asked, and a GPU recipe
that says when it finds no GPU."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import REPO, run_python

GLOO = "[Gloo] Rank"
SCRIPT = os.path.join(REPO, "tests", "_deploy", "probe.py")


@pytest.mark.multiprocess
@pytest.mark.parametrize("verbose", [False, True])
def test_launch_hides_gloo_connection_lines_unless_verbose(verbose):
    argv = ["-m", "jaxdist.cli", "launch", "-n", "2", "--devices-per-process", "1"]
    argv += ["--verbose"] if verbose else []
    proc = run_python(argv + [SCRIPT], timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert '"num_processes": 2' in out, out[-3000:]  # the processes did talk over gloo
    if verbose:
        assert f"[0] {GLOO} 0 is connected" in out and f"[1] {GLOO} 1 is connected" in out, out
    else:
        assert GLOO not in out, out


def _gpu_script(env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "JAX_"))}
    env.update(PYTHONPATH=REPO, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2", **env_extra)
    return subprocess.run(["bash", os.path.join(REPO, "examples", "deploy", "gpu", "train_gpu.sh"),
                           SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def test_gpu_recipe_says_loudly_that_it_found_no_gpu():
    out = _gpu_script({})
    if "NO GPU FOUND" not in out.stderr:
        pytest.skip("this machine has a GPU")
    assert out.returncode == 0, out.stderr[-3000:]  # still trains, on the CPU
    assert "runs on the CPU" in out.stderr


def test_gpu_recipe_can_require_a_gpu():
    out = _gpu_script({"JAXDIST_REQUIRE_GPU": "1"})
    if "NO GPU FOUND" not in out.stderr:
        pytest.skip("this machine has a GPU")
    assert out.returncode == 1 and "JAXDIST_REQUIRE_GPU=1" in out.stderr
