"""The persistent compilation cache `jaxdist train` and `jaxdist launch` use by default: a second
run compiles nothing new (issue 40)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from jaxdist.launch import compile_cache
from jaxdist.launch import launcher as launch
from tests.conftest import REPO

# Counts, in the child, the compilations that missed the cache (written to it) and those served
# from it, around `jaxdist train` run in-process through the CLI's own entry point.
COUNT = """
import json, sys, jax
seen = {"misses": 0, "hits": 0}
def on(name, *_, **__):
    if name == "/jax/compilation_cache/cache_misses": seen["misses"] += 1
    if name == "/jax/compilation_cache/cache_hits": seen["hits"] += 1
jax.monitoring.register_event_listener(on)
from jaxdist import cli
rc = cli.main(["train", "--strategy", "mirrored", "--devices", "2", "--epochs", "1", "--quiet",
               *sys.argv[1:]])
print("COUNTS", json.dumps({**seen, "rc": rc}))
"""


# The cache's own variables: a test of the cache's defaults starts without the suite's.
_CACHE_VARS = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAXDIST_COMPILE")


def _train(home, *args):
    # This test checks the CLI's own default: no cache from the suite, a home of its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith(_CACHE_VARS)}
    env.update(XDG_CACHE_HOME=str(home), JAXDIST_TEST_OWN_CACHE="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", COUNT, *args], capture_output=True, text=True,
                          timeout=240, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("COUNTS ")][-1]
    return json.loads(line.split(" ", 1)[1])


def test_a_second_jaxdist_train_compiles_nothing_new(tmp_path):
    first = _train(tmp_path)
    assert first["rc"] == 0 and first["misses"] > 0
    cached = os.path.join(tmp_path, "jaxdist", "xla")
    assert os.listdir(cached), "the default cache directory was not written"
    second = _train(tmp_path)
    assert second["rc"] == 0
    assert second["misses"] == 0, second
    assert second["hits"] >= first["misses"], (first, second)
    off = _train(tmp_path, "--no-compile-cache")
    assert off["hits"] == 0 and off["misses"] == 0, off


def test_the_cache_settings_follow_the_environment(tmp_path):
    assert compile_cache.cache_dir({"JAXDIST_COMPILE_CACHE": "0"}) is None
    assert compile_cache.cache_env({"JAXDIST_COMPILE_CACHE": "off"}) == {}
    env = compile_cache.cache_env({"JAXDIST_COMPILE_CACHE": str(tmp_path),
                                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "2"})
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path)
    assert "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in env  # the user's own stays


def test_entries_written_without_the_cap_are_healed(tmp_path):
    # plain JAX writing the same directory without the size cap leaves entries with no access
    # time, and JAX's capped writers then fail to write anything: heal() gives them one
    (tmp_path / "jit_f-abc-cache").write_bytes(b"x")
    (tmp_path / "jit_g-def-cache").write_bytes(b"y")
    (tmp_path / "jit_g-def-atime").write_bytes((1).to_bytes(8, "little"))
    assert compile_cache.heal(str(tmp_path)) == 1
    assert (tmp_path / "jit_f-abc-atime").exists()
    assert (tmp_path / "jit_g-def-atime").read_bytes() == (1).to_bytes(8, "little")
    assert compile_cache.heal(str(tmp_path / "missing")) == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("script", ["jaxdist", "plain"])
def test_a_multi_process_cpu_job_runs_again_with_the_same_cache(tmp_path, monkeypatch, script):
    # jax 0.12.x: a CPU executable with a cross-process collective, read back from the
    # persistent cache, waits in its collective for good. A jaxdist script is given a cache by
    # the environment (jaxdist.initialize turns it off in such a process); a plain JAX script
    # under the launcher gets the launcher's default cache (which the launcher then withholds).
    # Where the cache works (older JAX), the second run reads it.
    for name in list(os.environ):  # the launcher reads its own environment for the cache too
        if name.startswith(_CACHE_VARS):
            monkeypatch.delenv(name)
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAXDIST_COORDINATOR", "JAXDIST_NUM_PROCESSES", "JAXDIST_PROCESS_ID",
                        "JAX_NUM_CPU_DEVICES", "TF_CONFIG")}
    env.update(PYTHONPATH=REPO, JAXDIST_TEST_OWN_CACHE="1", XDG_CACHE_HOME=str(tmp_path))
    if script == "jaxdist":
        env.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    job = [os.path.join(REPO, "tests", "_mp_scripts", "psum_cached.py"),
           *(["--plain"] if script == "plain" else [])]
    counts = []
    for _ in range(2):
        result = launch.run(job, num_processes=2, devices_per_process=2, timeout_s=90, env=env)
        assert result.returncode == 0, result.output
        lines = [ln.split("] ", 1)[1] for ln in result.output.splitlines() if "] psum " in ln]
        assert len(lines) == 2 and all(ln.startswith("psum 10.0 ") for ln in lines), result.output
        counts.append([json.loads(ln.split(" cache ", 1)[1]) for ln in lines])
    broken = compile_cache._version(jax.__version__) >= compile_cache._CPU_MULTIPROCESS_BROKEN_FROM
    if broken:
        assert all(c["hits"] == 0 and c["misses"] == 0 for run in counts for c in run), counts
        if script == "plain":
            assert "no persistent compilation cache for this job" in result.output, result.output
    else:  # (process 0 reads it; JAX leaves the others to compile on their own)
        assert sum(c["hits"] for c in counts[1]) > 0, counts
