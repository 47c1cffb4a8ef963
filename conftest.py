"""Root conftest: every test and doctest sees 8 simulated CPU devices, and the suite's processes
share one persistent compilation cache.

This must run before anything starts JAX's backend, hence here and not in tests/.

The cache (``~/.cache/jaxdist/tests-xla``, or ``JAXDIST_TEST_COMPILE_CACHE``; kept between runs,
capped by JAX at 1 GiB) serves the pytest process and every process the suite starts: this
process's environment carries it, and ``_with_cache`` below adds it to every explicit ``env=`` a
test hands to ``subprocess`` (``launch.run`` and notebook kernels start theirs the same way), so a
test that builds a minimal environment still compiles nothing another process already compiled.
A test that checks a process's own cache handling sets ``JAXDIST_TEST_OWN_CACHE=1`` in the
environment it passes, and gets exactly that environment.
"""

import os
import subprocess

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jaxdist.launch import compile_cache  # noqa: E402 - after the device count

_CACHE = os.environ.get("JAXDIST_TEST_COMPILE_CACHE") or os.path.join(
    compile_cache.default_dir(), os.pardir, "tests-xla")
os.environ.setdefault(compile_cache.ENV_CACHE, os.path.normpath(_CACHE))
os.environ.setdefault(compile_cache.ENV_CACHE_MAX_BYTES, str(1 << 30))
CACHE_ENV = {compile_cache.ENV_CACHE: os.environ[compile_cache.ENV_CACHE],
             compile_cache.ENV_CACHE_MAX_BYTES: os.environ[compile_cache.ENV_CACHE_MAX_BYTES]}
CACHE_ENV.update(compile_cache.cache_env(os.environ))
os.environ.update(CACHE_ENV)
compile_cache.enable()

_popen_init = subprocess.Popen.__init__


def _with_cache(self, args, *rest, env=None, **kw):
    if env is not None and not env.get("JAXDIST_TEST_OWN_CACHE"):
        env = {**CACHE_ENV, **env}
    _popen_init(self, args, *rest, env=env, **kw)


subprocess.Popen.__init__ = _with_cache  # type: ignore[method-assign]

# A deprecated path's stub module warns when imported (a DeprecationWarning, an error in this
# suite): the doctest collector must not import it. tests/test_layout.py imports every moved path.
collect_ignore = ["jaxdist/launch/memstate.py", "jaxdist/launch/slot_files.py"]


# ----- the suite's order, its secondary leg, and what it leaves behind (issue 40) -------------

import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

# The suite's own temporary root: every process the suite starts writes its temporary files
# there (TMPDIR, and the pytest process's tempfile), and a green run removes it whole.
_REAL_TMP = tempfile.gettempdir()
SUITE_TMP = tempfile.mkdtemp(prefix="jaxdist-suite-", dir=_REAL_TMP)
os.environ["TMPDIR"] = SUITE_TMP
tempfile.tempdir = SUITE_TMP
CACHE_ENV["TMPDIR"] = SUITE_TMP
_SHM = "/dev/shm"
_STARTED = time.time()


def _entries(where: str) -> set[str]:
    try:
        return set(os.listdir(where))
    except OSError:
        return set()


_BEFORE = {_SHM: _entries(_SHM), _REAL_TMP: _entries(_REAL_TMP) | {os.path.basename(SUITE_TMP)}}

# Files whose subject is JAX's own behaviour (numerics, sharding, compilation): the newest-JAX leg
# runs every case of them; elsewhere it runs one case per parametrized test (JAXDIST_TEST_ONE_CASE).
JAX_SENSITIVE = {"test_strategies.py", "test_invariance.py", "test_collectives.py",
                 "test_per_replica.py", "test_zero.py", "test_user_mesh.py", "test_cross_device.py",
                 "test_compile.py", "test_tf_parity.py", "test_precision.py", "test_run_reduce.py"}


def _heavy(item) -> bool:
    return item.get_closest_marker("multiprocess") is not None or \
        item.get_closest_marker("slow") is not None


def pytest_collection_modifyitems(config, items):
    if os.environ.get("JAXDIST_TEST_ONE_CASE") == "1":
        seen, keep, dropped = set(), [], []
        for item in items:
            spec = getattr(item, "callspec", None)
            key = (str(item.path), getattr(item, "originalname", item.name))
            if spec is None or item.path.name in JAX_SENSITIVE or key not in seen:
                seen.add(key)
                keep.append(item)
            else:
                dropped.append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    # In-process tests first, the tests that start processes or run long last: a broken change
    # shows in minutes (with --maxfail, the run stops there), and the slow tier runs on a warm cache.
    items.sort(key=_order)


# The slow tier's longest files first (CI's per-file table, December 2026): under `pytest -n 2` a
# long test that starts last keeps one worker busy while the other has nothing left to do.
_LONG_FIRST = ("test_gpt_bench.py", "test_elastic_faults.py", "test_examples.py",
               "test_benchmarks.py", "test_elastic_multihost.py", "test_elastic.py",
               "test_hardening_round5.py", "test_multi_worker.py", "test_steps_per_execution.py",
               "test_elastic_tier_bound.py")


def _order(item) -> tuple[int, int]:
    if not _heavy(item):
        return (0, 0)
    name = item.path.name
    return (1, _LONG_FIRST.index(name) if name in _LONG_FIRST else len(_LONG_FIRST))


def _xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionfinish(session, exitstatus):
    if _xdist_worker(session.config):
        # A worker of `pytest -n N` removes only its own temporary root: /dev/shm and the real
        # temporary directory hold the other workers' live files until the controller's check.
        if exitstatus == 0:
            shutil.rmtree(SUITE_TMP, ignore_errors=True)
        return
    # Kept in-memory states of jobs the suite failed on purpose (a launcher keeps one for a
    # resume): the suite made them, the suite removes them.
    for name in _entries(_SHM) - _BEFORE[_SHM]:
        if name.startswith("jaxdist-state-kept-"):
            shutil.rmtree(os.path.join(_SHM, name), ignore_errors=True)
    if exitstatus != 0:
        print(f"\nthe suite's temporary files are kept in {SUITE_TMP}")
        return
    shutil.rmtree(SUITE_TMP, ignore_errors=True)
    if os.environ.get("JAXDIST_TEST_LEFTOVER_CHECK", "1") == "0":
        return
    left = []
    for where, before in _BEFORE.items():
        for name in sorted(_entries(where) - before):
            if name.startswith("jaxdist-suite-"):  # another run's own root (kept when it was red)
                continue
            path = os.path.join(where, name)
            try:
                if os.stat(path).st_mtime >= _STARTED - 1:
                    left.append(path)
            except OSError:
                continue
    if left:
        print("\nthe suite left these behind (a test or the code under test does not clean up; "
              "JAXDIST_TEST_LEFTOVER_CHECK=0 skips this check when other work shares the "
              f"machine): {', '.join(left[:20])}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # Every phase (setup, call, teardown) of every test, by file: the table CI prints at the end.
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # With --durations (CI's runs): where the suite's time goes, per test file.
    if not config.getoption("durations", None) or not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    ranked = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"time by test file (setup + call + teardown; {total:.0f} s "
                                    f"in {len(ranked)} files)")
    for path, seconds in ranked[:30]:
        terminalreporter.write_line(f"{seconds:8.1f} s {seconds / total:6.1%}  {path}")
    if len(ranked) > 30:
        rest = sum(s for _, s in ranked[30:])
        terminalreporter.write_line(f"{rest:8.1f} s {rest / total:6.1%}  the other "
                                    f"{len(ranked) - 30} files")
