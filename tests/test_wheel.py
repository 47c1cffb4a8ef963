"""The wheel, not only the editable install: it carries py.typed and LICENSE, installs, and trains.

Builds the wheel from this checkout with the installed setuptools (no build isolation, so no
network), installs it with ``--no-deps`` into a fresh virtual environment that reuses the
dependencies this interpreter already has, and runs that environment's ``jaxdist train`` from an
empty directory with PYTHONPATH unset, checking that the package it imported is the wheel's.

The dependencies are reused through a ``.pth`` file naming this interpreter's site-packages
folders, not ``--system-site-packages``: that option gives the *base* interpreter's packages,
which are not these when the suite runs in a virtual environment (README's ``python -m venv v &&
pip install -e ".[test]"``: ``No module named 'jax'``). A ``.pth`` path line adds the folder
without running the ``.pth`` files in it, so this checkout's editable install stays out.
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


def _site_packages() -> list[str]:
    """The folders this interpreter imports installed packages from (its virtual environment's
    site-packages when it runs in one, and the user site when that is on)."""
    import site

    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def make_venv(env_dir) -> str:
    """A fresh virtual environment that imports this interpreter's installed packages (after its
    own); returns its python."""
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = os.path.join(env_dir, "bin", "python")
    own = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    with open(os.path.join(own, "_outer_site_packages.pth"), "w") as f:
        f.write("".join(d + "\n" for d in _site_packages()))
    return python


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # Under pytest-xdist each worker that runs a test of this module builds the fixture, and two
    # builds of one checkout collide in its build/ directory ("File exists: build/bdist...",
    # once under -n 2): the workers share one wheel, built by the first under a lock.
    import fcntl

    base = tmp_path_factory.getbasetemp()  # under xdist, this run's folder is its parent
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "jaxdist-wheel"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = list(shared.glob("jaxdist-*.whl"))
        return built[0] if built else _build_wheel(shared)


def _build_wheel(out):
    try:
        import setuptools  # noqa: F401 - the build backend, used without isolation (offline)
        offline = ["--no-build-isolation", "--no-index"]
    except ImportError:  # a Python >= 3.12 venv has no setuptools: pip fetches it to build
        offline = []
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *offline, "--quiet",
                           "--disable-pip-version-check", "-w", str(out), REPO],
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
    python = make_venv(env_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_NUM_CPU_DEVICES")}
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                           "--no-index", "--quiet", "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0 and "no such option: --python" in proc.stderr:  # pip < 22.3
        proc = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                               str(wheel)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    work = tmp_path / "empty"
    work.mkdir()
    where = subprocess.run([python, "-c", "import jaxdist; print(jaxdist.__file__)"],
                           capture_output=True, text=True, cwd=work, env=env, timeout=120)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(env_dir)), where.stdout  # the wheel's copy
    proc = subprocess.run([str(env_dir / "bin" / "jaxdist"), "train", "--strategy", "mirrored",
                           "--devices", "2", "--epochs", "1", "--quiet"],
                          capture_output=True, text=True, cwd=work, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "test accuracy" in out, out[-3000:]
