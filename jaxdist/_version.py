"""The package's version, for the modules of its subpackages (``jaxdist.__version__`` is this).

Read from the installed distribution's metadata; a source tree that was never installed (no
metadata) reads ``pyproject.toml`` beside the package.
"""

from __future__ import annotations

import os
from importlib import metadata


def _from_source() -> str:
    import tomllib

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "0+unknown"


try:
    __version__: str = metadata.version("jaxdist")
except metadata.PackageNotFoundError:
    __version__ = _from_source()
