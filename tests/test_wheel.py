"""The wheel, not only the editable install: it carries py.typed and LICENSE, installs, and trains.

Builds the wheel from this checkout with the installed setuptools (no build isolation, so no
network), installs it with ``--no-deps`` into a fresh virtual environment that reuses the
already-installed dependencies (``--system-site-packages``), and runs that environment's
``jaxdist train`` from an empty directory with PYTHONPATH unset, checking that the package it
imported is the wheel's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile

import pytest

import jaxdist
from tests.conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "--quiet", "--disable-pip-version-check", "-w", str(out), REPO],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("jaxdist-*.whl")
    return path


def test_wheel_carries_py_typed_license_and_version(wheel):
    assert wheel.name.startswith(f"jaxdist-{jaxdist.__version__}-"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "jaxdist/py.typed" in names
    assert any(n.endswith("/LICENSE") and ".dist-info/" in n for n in names), names
    assert any(n.endswith(".dist-info/METADATA") for n in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Typing :: Typed" in metadata and "Project-URL: Documentation" in metadata
    assert not any(n.startswith(("tests/", "docs/", "benchmarks/")) for n in names), names


def test_wheel_installs_in_a_fresh_venv_and_trains(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_NUM_CPU_DEVICES")}
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                           "--no-index", "--quiet", "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0 and "no such option: --python" in proc.stderr:  # pip < 22.3
        proc = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                               str(wheel)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    work = tmp_path / "empty"
    work.mkdir()
    where = subprocess.run([str(python), "-c", "import jaxdist; print(jaxdist.__file__)"],
                           capture_output=True, text=True, cwd=work, env=env, timeout=120)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(env_dir)), where.stdout  # the wheel's copy
    proc = subprocess.run([str(env_dir / "bin" / "jaxdist"), "train", "--strategy", "mirrored",
                           "--devices", "2", "--epochs", "1", "--quiet"],
                          capture_output=True, text=True, cwd=work, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "test accuracy" in out, out[-3000:]
