"""The package's version, for the modules of its subpackages (``jaxdist.__version__`` is this)."""

__version__ = "0.3.0"
