"""The end of README's test command is readable: third-party noise filtered, jaxdist's kept.

Runs pytest in a subprocess with this checkout's pyproject.toml on a generated test file (issue
30: a full run ended with a 330-line summary of TensorStore's "Event loop is closed" tracebacks).
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO

TESTS = '''
import asyncio, sys, types, warnings

def _unraisable(exc):  # how a C extension reports an error in its callback thread
    sys.unraisablehook(types.SimpleNamespace(exc_type=type(exc), exc_value=exc,
                       exc_traceback=exc.__traceback__, err_msg=None, object=None))

def test_tensorstore_callback_into_a_closed_loop():
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(lambda: None)
    except RuntimeError as e:
        _unraisable(e)

def test_an_unraisable_error_of_our_own():
    try:
        raise ValueError("a callback of ours failed")
    except ValueError as e:
        _unraisable(e)

def test_a_jax_deprecation_is_an_error():
    warnings.warn_explicit("old API", DeprecationWarning, "x.py", 1, module="jax._src.api")
'''


def test_third_party_unraisables_are_filtered_and_ours_and_jax_deprecations_are_not(tmp_path):
    (tmp_path / "test_generated.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           os.path.join(REPO, "pyproject.toml"), "--rootdir", str(tmp_path),
                           str(tmp_path / "test_generated.py")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "1 failed, 2 passed, 1 warning" in out, out  # the deprecation fails its test
    assert "Event loop is closed" not in out, out
    assert "a callback of ours failed" in out, out
