"""Stub modules of the module paths that moved in 0.4.0 (see ``jaxdist._compat``): each one is
imported as ``jaxdist.<name>`` through ``jaxdist.__path__``."""
