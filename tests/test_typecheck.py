"""The type checker CI runs (.ci/run; configured in pyproject.toml's [tool.mypy]) is clean on
jaxdist/, and fails on a type error planted in a copy of the package."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

# slow: .ci/run's floor leg runs it (and mypy itself); the newest-JAX leg would check the code
# against another JAX's annotations, which the pinned floor is the reference for.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                                 reason="mypy is not installed (pip install -e '.[test]' installs it)")]

CONFIG = os.path.join(REPO, "pyproject.toml")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # one cache for both runs: the planted copy re-checks what changed only
    return str(tmp_path_factory.mktemp("mypy_cache"))


def _mypy(cwd: str, cache: str, *paths: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", CONFIG, "--cache-dir", cache,
                           "--no-error-summary", *paths], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def test_the_package_type_checks_clean(cache):
    proc = _mypy(REPO, cache)  # the files pyproject.toml names: jaxdist/
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "error:" not in proc.stdout


def test_a_planted_type_error_fails_the_check(cache, tmp_path):
    shutil.copytree(os.path.join(REPO, "jaxdist"), tmp_path / "jaxdist",
                    ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "jaxdist" / "core" / "loss.py"
    with open(target, "a", encoding="utf-8") as f:
        f.write("\n\ndef _planted(n: int) -> int:\n    return str(n)\n")
    proc = _mypy(str(tmp_path), cache, "jaxdist")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "jaxdist/core/loss.py" in errors[0], errors
    assert "Incompatible return value type" in errors[0] and "[return-value]" in errors[0], errors
