"""``jaxdist.step`` is ``jaxdist.core.step`` (deprecated: removed in jaxdist 0.5.0)."""

from jaxdist._compat import alias

alias("jaxdist.step")
