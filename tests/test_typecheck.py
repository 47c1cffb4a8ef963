"""The type checker CI runs once, as its own step (.ci/run: `mypy` over jaxdist/, configured in
pyproject.toml's [tool.mypy]), fails on a type error: a planted one, checked under the project's
own configuration. The package itself is checked by that CI step, not again here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                                reason="mypy is not installed (pip install -e '.[test]' installs it)")

CONFIG = os.path.join(REPO, "pyproject.toml")


def test_a_planted_type_error_fails_the_check(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def _planted(n: int) -> int:\n    return str(n)\n\n\n"
                       "def _fine(n: int) -> int:\n    return n + 1\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", CONFIG, "--cache-dir",
                           str(tmp_path / "cache"), "--no-error-summary", str(planted)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "planted.py:2" in errors[0], errors
    assert "Incompatible return value type" in errors[0] and "[return-value]" in errors[0], errors
