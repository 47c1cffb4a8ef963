"""``jaxdist.mesh`` is ``jaxdist.core.mesh`` (deprecated: removed in jaxdist 0.5.0)."""

from jaxdist._compat import alias

alias("jaxdist.mesh")
