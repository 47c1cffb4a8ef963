"""``jaxdist.input_local`` is ``jaxdist.input.local`` (deprecated: removed in jaxdist 0.5.0)."""

from jaxdist._compat import alias

alias("jaxdist.input_local")
